"""Loops (while_loop, fori_loop, scan over stacked layers) partitioned like the rest:
the carry keeps one layout, weights sliced per iteration stay split."""
import jax
import jax.numpy as jnp
import numpy as np

import gspmd
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def stacked_mlp(ws, x):
    """L layers of x @ w, the layer weights stacked [L, D, D] and split on both D."""
    ws = gspmd.mesh_split(ws, MESH, [-1, -1, "y"])
    x = gspmd.mesh_split(x, MESH, ["x", -1])

    def layer(h, w):
        h = jnp.tanh(h @ w)
        return h, h.sum()
    return jax.lax.scan(layer, x, ws)


def test_scan_over_sharded_layer_stack_keeps_weights_split():
    rng = np.random.RandomState(0)
    ws, x = rand(rng, 3, 8, 8) / 3, rand(rng, 4, 8)
    low = check(stacked_mlp, ws, x, mesh=MESH)
    report = low.report()
    assert "all-gather" not in report.counts() or all(c.bytes < 8 * 8 * 4 for c in report.collectives
                                                      if c.kind == "all-gather")
    assert any(c.executions == 3 for c in report.collectives)   # counted per iteration
    body = next(p for p in low.spmd.subprograms() if p.name.endswith("body.spmd"))
    weights_in_body = [v for v in body.params if v.shape[1:] == (8, 2)]
    assert weights_in_body, [v.type_str() for v in body.params]   # [L, D, D/4] per device


def test_grad_through_scan():
    rng = np.random.RandomState(1)
    ws, x = rand(rng, 3, 8, 8) / 3, rand(rng, 4, 8)

    def step(ws, x):
        loss = lambda w: jnp.sum(stacked_mlp(w, x)[0] ** 2)
        return ws - 0.1 * jax.grad(loss)(ws)

    low = check(step, ws, x, mesh=MESH)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, [-1, -1, "y"], ws.shape)


def test_transposed_scan_carries_no_constant_its_body_ignores():
    # The backward scan of a relu stack gets a zeros buffer the size of a whole activation
    # as a constant it never reads; carried, it would stay whole on every device.
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))

    def loss(ws, x):
        def body(h, w):
            return jax.nn.relu(gspmd.mesh_split(h, mesh, ["x", "y"]) @ w), None
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    rng = np.random.RandomState(3)
    low = check(jax.grad(loss), rand(rng, 3, 64, 64) / 8, rand(rng, 16, 64), mesh=mesh)
    carried = [o.shape for i in low.spmd.instrs if i.opcode == "while" for o in i.operands]
    assert (16, 64) not in carried, carried


def test_while_and_fori_loops():
    def f(x, n):
        x = gspmd.mesh_split(x, MESH, ["y", "x"])
        doubled = jax.lax.while_loop(lambda c: c.sum() < 1000.0, lambda c: c * 2 + 1, x)
        counted = jax.lax.fori_loop(0, n, lambda i, c: c + i * x, x)
        return doubled, counted

    rng = np.random.RandomState(2)
    check(f, np.abs(rand(rng, 6, 5)), np.int32(4), mesh=MESH)


def test_reverse_scan_with_uneven_carry():
    def f(xs, c):
        xs = gspmd.mesh_split(xs, MESH, [-1, "y", -1])
        return jax.lax.scan(lambda c, x: (c * 0.5 + x, c.max(0)), c, xs, reverse=True)

    rng = np.random.RandomState(3)
    check(f, rand(rng, 4, 7, 3), rand(rng, 7, 3), mesh=MESH)


def test_values_inside_loop_bodies_can_be_inspected():
    rng = np.random.RandomState(4)
    low = gspmd.jit(stacked_mlp, mesh=MESH).lower(rand(rng, 3, 8, 8), rand(rng, 4, 8))
    body = next(p for p in low.program.subprograms() if p.name.endswith("body"))
    dot = next(i for i in body.instrs if i.opcode == "dot").output
    assert low.sharding_of(dot.name) == gspmd.Sharding.from_mesh(MESH, ["x", "y"], dot.shape)
    assert "annotation" in low.explain(dot.name)
    assert "main.body" in low.as_text() or "body(" in low.as_text()


def test_annotations_only_inside_a_loop_body_set_the_device_count():
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + gspmd.mesh_split(x, MESH, ["x", "y"]).sum(), None), 0.0, xs)[0]

    xs = np.random.RandomState(5).standard_normal((3, 4, 8)).astype(np.float32)
    low = check(f, xs)                          # no jit(mesh=...): the body's annotation decides
    assert low.num_devices == 8


def test_a_manual_region_alone_sets_the_device_count():
    f = gspmd.manual(lambda a: jax.lax.psum(a, "x"), MESH, [["x", "y"]], [[-1, "y"]])
    assert gspmd.jit(f).lower(np.zeros((4, 8), np.float32)).num_devices == 8


def test_a_vmapped_while_loop_steps_each_element_until_its_own_condition_fails():
    """jax.vmap of a while loop: one loop whose condition is a bool per element (loop while
    any holds; an element whose condition fails keeps its value), over a batch split
    unevenly (6 over 4)."""
    def count_up(v):
        return jax.lax.while_loop(lambda c: c[0] < v, lambda c: (c[0] + 1.0, c[1] * 2.0), (0.0, v))

    def f(x):
        return jax.vmap(count_up)(gspmd.mesh_split(x, MESH, [("x", "y")]))
    check(f, np.array([0.5, 3.0, -1.0, 2.2, 7.0, 1.0], np.float32), mesh=MESH)


def test_a_scan_of_one_step_is_inlined_as_xla_inlines_it():
    """A stage of one layer (a pipeline's stage, a circular schedule's repeat) scans once:
    its body runs in place, forward and backward, with no loop around it (XLA's while-loop
    simplifier inlines loops that run once), so its weights need no copy into a carry."""
    rng = np.random.RandomState(4)
    ws, x = rand(rng, 1, 8, 8) / 3, rand(rng, 6, 8)

    def step(ws, x):
        loss = lambda w: jnp.sum(stacked_mlp(w, x)[0] ** 2) + jnp.sum(jax.lax.scan(
            lambda c, w: (c * 2, c @ w), x[0], w, reverse=True)[1])
        return ws - 0.1 * jax.grad(loss)(ws)

    low = check(step, ws, x, mesh=MESH)
    assert all(i.opcode != "while" for p in [low.spmd, *low.spmd.subprograms()] for i in p.instrs)


def test_a_scan_of_no_steps_returns_its_carries_and_empty_stacks():
    """A scan over nothing (xs of length 0, split or not) runs no step: its carries come
    back as they went in, its stacked outputs are [0, ...] (XLA's while-loop simplifier
    removes a loop that never runs); its gradients likewise, with no loop and nothing moved."""
    rng = np.random.RandomState(5)
    c, xs, w = rand(rng, 8), rand(rng, 0, 8), rand(rng, 0, 8, 8)

    def scans(c, xs, w):
        c = gspmd.mesh_split(c, MESH, ["y"])
        def body(c, x):
            return jnp.tanh(c * 2 + x), (c * x).sum()
        forward = jax.lax.scan(body, c, gspmd.mesh_split(xs, MESH, [None, "y"]))
        backward = jax.lax.scan(lambda c, w: (c @ w, c), c, gspmd.mesh_split(w, MESH, ["x", None, "y"]), reverse=True)
        counted = jax.lax.scan(lambda c, _: (c + 1, c), c, None, length=0)
        return forward, backward, counted, jax.lax.fori_loop(3, 3, lambda i, c: c * i, c)

    def grads(c, xs, w):
        loss = lambda c, xs, w: sum(jnp.sum(v ** 2) for v in jax.tree.leaves(scans(c, xs, w)))
        return jax.grad(loss, (0, 1, 2))(c, xs, w)
    for fn in (scans, grads):
        low = check(fn, c, xs, w, mesh=MESH)
        assert all(i.opcode != "while" for p in [low.spmd, *low.spmd.subprograms()] for i in p.instrs)
        assert not low.report().collectives, str(low.report())


def test_a_scan_unrolled_whole_is_inlined_as_jax_lowers_it():
    """lax.scan(..., unroll=True) (penzai's LayerStack scans so): jax.jit's program has
    no loop but each step on static slices of the stacked inputs, and so has ours
    (issue 46: the loop of dynamic slices cost XLA a fifth more compile time on penzai's
    step), forward and backward, reversed too; it moves the kinds of data the loop does."""
    rng = np.random.RandomState(6)
    ws, x = rand(rng, 3, 8, 8) / 3, rand(rng, 6, 8)

    def step(ws, x, unroll=True):
        def loss(ws):
            ws = gspmd.mesh_split(ws, MESH, [-1, -1, "y"])
            h, sums = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h.sum()), gspmd.mesh_split(x, MESH, ["x", -1]),
                                   ws, unroll=unroll)
            back, stacked = jax.lax.scan(lambda c, w: (c * 2, c @ w), h[0], ws, reverse=True,
                                         unroll=3 if unroll else 1)
            return jnp.sum(h ** 2) + jnp.sum(sums) + jnp.sum(back) + jnp.sum(stacked[0] * stacked[2])
        return ws - 0.1 * jax.grad(loss)(ws)

    low = check(step, ws, x, mesh=MESH)
    assert all(i.opcode != "while" for p in [low.spmd, *low.spmd.subprograms()] for i in p.instrs)
    looped = gspmd.jit(lambda ws, x: step(ws, x, unroll=False), mesh=MESH).lower(ws, x)
    assert any(i.opcode == "while" for i in looped.spmd.instrs)
    assert {c.kind for c in low.report().collectives} == {c.kind for c in looped.report().collectives}
