"""Embedding lookups and their gradients: gather and scatter-add with the table split on
its vocab or model dim and the ids split on batch, vs one device (sim and jax)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import gspmd
from strategies import dims_mappings, meshes
from util import BACKENDS, check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
TABLE_LAYOUTS = [["x", -1], [-1, "y"], [("x", "y"), -1], ["y", "x"], [-1, -1]]


def lookup(table_map, ids_map):
    def f(table, ids):
        table = gspmd.mesh_split(table, MESH, table_map)
        return table[gspmd.mesh_split(ids, MESH, ids_map)]
    return f


def train_step(table_map, ids_map):
    def step(table, ids):
        loss = lambda t: jnp.sum(jnp.tanh(lookup(table_map, ids_map)(t, ids)) ** 2)
        return table - 0.1 * jax.grad(loss)(table)
    return step


@pytest.mark.parametrize("table_map", TABLE_LAYOUTS)
def test_embedding_lookup_and_gradient(table_map):
    rng = np.random.RandomState(0)
    table, ids = rand(rng, 11, 6), rng.randint(0, 11, (4, 3)).astype(np.int32)   # 11 rows: uneven
    check(lookup(table_map, ["x", -1]), table, ids, mesh=MESH)
    low = check(train_step(table_map, ["x", -1]), table, ids, mesh=MESH)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, table_map, table.shape)


def test_vocab_split_table_answers_locally_and_sums():
    """Megatron-style vocab-parallel embedding: no table movement, one all-reduce."""
    rng = np.random.RandomState(1)
    table, ids = rand(rng, 16, 8), rng.randint(0, 16, (4, 6)).astype(np.int32)
    low = check(lookup(["y", "x"], [-1, -1]), table, ids, mesh=MESH)
    (c,) = low.report().collectives
    assert c.kind == "all-reduce" and c.bytes == 4 * 6 * (8 // 2) * 4   # output [B, S, M/x] summed over y
    assert set(c.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_model_split_table_gradient_all_reduces_over_batch_only():
    rng = np.random.RandomState(2)
    table, ids = rand(rng, 10, 8), rng.randint(0, 10, (4, 3)).astype(np.int32)
    low = check(train_step([-1, "y"], ["x", -1]), table, ids, mesh=MESH)
    (c,) = low.report().collectives
    assert c.kind == "all-reduce" and set(c.groups) == {(0, 4), (1, 5), (2, 6), (3, 7)}


def test_take_modes_and_scatter_variants():
    rng = np.random.RandomState(3)
    table = rand(rng, 10, 6)
    idx = np.array([[0, 5, 7], [1, 2, 9]], np.int32)
    check(lambda t, i: jnp.take(gspmd.mesh_split(t, MESH, [-1, "y"]), i, axis=1), table, idx, mesh=MESH)
    check(lambda t, i: jnp.take(gspmd.mesh_split(t, MESH, ["x", -1]), i, axis=0, mode="clip"), table, idx + 3,
          mesh=MESH)
    rows = np.array([1, 2, 9, 2], np.int32)
    check(lambda t, i: gspmd.mesh_split(t, MESH, ["x", -1]).at[i].add(1.0), table, rows, mesh=MESH)
    check(lambda t, i: gspmd.mesh_split(t, MESH, ["x", "y"]).at[i].max(0.5), table, rows, mesh=MESH)
    check(lambda t, i: gspmd.mesh_split(t, MESH, ["y", -1]).at[i[:3]].set(2.0), table, rows, mesh=MESH)


@st.composite
def lookup_cases(draw):
    mesh = draw(meshes(shapes=[(2, 4), (4, 2), (8,), (2, 2, 2)]))
    vocab, width = draw(st.sampled_from([3, 8, 13])), draw(st.sampled_from([1, 4, 6]))
    ids_shape = tuple(draw(st.sampled_from([1, 2, 5, 8])) for _ in range(draw(st.integers(1, 2))))
    return mesh, vocab, width, ids_shape, draw(dims_mappings(mesh, 2)), draw(dims_mappings(mesh, len(ids_shape)))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(lookup_cases())
def test_random_lookups_and_gradients(case):
    mesh, vocab, width, ids_shape, table_map, ids_map = case
    rng = np.random.RandomState(4)
    table, ids = rand(rng, vocab, width), rng.randint(0, vocab, ids_shape).astype(np.int32)

    def step(t, i):
        def loss(t):
            e = gspmd.mesh_split(t, mesh, table_map)[gspmd.mesh_split(i, mesh, ids_map)]
            return jnp.sum(e * e)
        return t - 0.1 * jax.grad(loss)(t)

    got = gspmd.jit(step, mesh=mesh)(table, ids)
    np.testing.assert_allclose(got, jax.jit(step)(table, ids), rtol=1e-5, atol=1e-5)


# -- batching dims, passthrough dims, fill modes, scatter combiners ------------------------
def test_take_along_axis_on_batch_split_operand_needs_no_collective():
    rng = np.random.RandomState(5)
    logits, labels = rand(rng, 6, 11), rng.randint(0, 11, (6, 3)).astype(np.int32)
    low = check(lambda l, y: jnp.take_along_axis(gspmd.mesh_split(l, MESH, [("x", "y"), -1]), y, axis=1),
                logits, labels, mesh=MESH)
    assert low.report().collectives == []


@pytest.mark.parametrize("row", [1, 3, 5, -7])
def test_dropped_scatter_indices_leave_every_shard_alone(row):
    """An index off a device's shard (or off the array: dropped) must not write into the
    neighbouring shard (XLA:CPU did, on the jax backend, for uneven shards)."""
    mesh = gspmd.Mesh(np.arange(3), ("a",))

    def f(x, u):
        return gspmd.mesh_split(x, mesh, ["a", -1]).at[jnp.array([row])].set(u, mode="drop")

    check(f, np.arange(1, 6, dtype=np.float32).reshape(5, 1), np.full((1, 1), 100, np.float32), mesh=mesh)


def test_vocab_split_take_with_fill_mode_sums_one_small_result():
    """jnp.take's default mode fills out-of-range rows with NaN: each device answers for
    its rows, the first one for rows nobody holds; no table moves."""
    rng = np.random.RandomState(6)
    table, ids = rand(rng, 16, 8), np.array([[0, 3, 15, 16, -1, 7], [20, 2, 9, -20, 5, 1]], np.int32)
    for fill in (None, -3.0):
        low = check(lambda t, i: jnp.take(gspmd.mesh_split(t, MESH, ["y", "x"]), i, axis=0, fill_value=fill),
                    table, ids, mesh=MESH)
        (c,) = low.report().collectives
        assert c.kind == "all-reduce" and c.bytes == 2 * 6 * (8 // 2) * 4


@pytest.mark.parametrize("logits_map", [[("x", "y"), -1], ["x", "y"], [-1, "y"]])
def test_integer_label_cross_entropy_and_gradient(logits_map):
    """The LM loss: beyond logsumexp's own all-reduces (max and sum over a split vocab),
    at most one small all-reduce (the label logits); the gradient adds none."""
    import optax
    rng = np.random.RandomState(7)
    logits, labels = rand(rng, 6, 13), rng.randint(0, 13, (6,)).astype(np.int32)

    def split(l):
        return gspmd.mesh_split(l, MESH, logits_map)

    def loss(l, y):
        return optax.softmax_cross_entropy_with_integer_labels(split(l), y).mean()

    def own(l, y):
        return jax.nn.logsumexp(split(l), axis=-1).mean()

    for fn, extra in ((loss, 1), (jax.grad(loss), 0)):
        got = check(fn, logits, labels, mesh=MESH).report()
        base = gspmd.jit(own if fn is loss else jax.grad(own), mesh=MESH).lower(logits, labels).report()
        assert set(got.counts()) <= {"all-reduce"}, str(got)
        added = got.counts()["all-reduce"] - base.counts()["all-reduce"]
        assert added <= extra, (str(got), str(base))
        assert all(c.bytes <= 6 * 4 for c in got.collectives), str(got)   # per-example values at most


def test_index_and_operand_passthrough_dims_stay_split_together():
    rng = np.random.RandomState(10)
    table, ids = rand(rng, 10, 8), rng.randint(0, 10, (4, 3)).astype(np.int32)
    low = check(lambda t, i: gspmd.mesh_split(t, MESH, [-1, "y"])[gspmd.mesh_split(i, MESH, ["x", -1])], table, ids,
                mesh=MESH)
    assert low.report().collectives == []
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(MESH, ["x", -1, "y"], (4, 3, 8))


def test_vmapped_dynamic_slice_keeps_passthrough_dims_split():
    """vmap(dynamic_slice) gathers with batching dims and indexes a dim it takes whole:
    both stay split with no communication."""
    rng = np.random.RandomState(8)
    x, starts = rand(rng, 5, 9, 6), rng.randint(-2, 11, (5,)).astype(np.int32)

    def f(x, s):
        x = gspmd.mesh_split(x, MESH, ["x", -1, "y"])
        return jax.vmap(lambda t, i: jax.lax.dynamic_slice(t, (i, 0), (2, 6)))(x, s)
    low = check(f, x, starts, mesh=MESH)
    assert low.report().collectives == []
    low = check(lambda x, s: jax.grad(lambda x: (f(x, s) ** 2).sum())(x), x, starts, mesh=MESH)
    assert low.report().collectives == []


@pytest.mark.parametrize("op", ["set", "add", "multiply", "min", "max", "subtract"])
def test_scatter_combiners_on_a_row_split_operand_write_locally(op):
    rng = np.random.RandomState(9)
    table, rows, updates = rand(rng, 11, 6), np.array([1, 2, 10, 4, 7], np.int32), rand(rng, 5, 6)
    for table_map in (["y", -1], ["x", "y"]):
        low = check(lambda t, i, u: getattr(gspmd.mesh_split(t, MESH, table_map).at[i], op)(u), table, rows, updates,
                    mesh=MESH)
        assert low.report().collectives == [], str(low.report())


# Random programs over gather and scatter: each family draws shapes, index values (some
# out of range), a mode, and a layout for every argument.
def _take_along_axis(draw, rng):
    shape = [draw(st.sampled_from([1, 3, 4, 7])) for _ in range(draw(st.integers(2, 3)))]
    axis = draw(st.integers(0, len(shape) - 1))
    idx_shape = list(shape)
    idx_shape[axis] = draw(st.sampled_from([1, 2, 3]))
    mode = draw(st.sampled_from([None, "clip"]))
    n = shape[axis]
    args = rand(rng, *shape), rng.randint(-n - 2, n + 2, idx_shape).astype(np.int32)
    return (lambda x, i: jnp.take_along_axis(x, i, axis=axis, mode=mode)), args, f"take_along_axis {axis=} {mode=}"


def _take(draw, rng):
    v, m = draw(st.sampled_from([1, 5, 8])), draw(st.sampled_from([2, 3, 8]))
    ids_shape = tuple(draw(st.sampled_from([1, 3, 4])) for _ in range(draw(st.integers(1, 2))))
    axis, mode = draw(st.integers(0, 1)), draw(st.sampled_from([None, "clip", "fill"]))
    n = (v, m)[axis]
    args = rand(rng, v, m), rng.randint(-n - 2, n + 2, ids_shape).astype(np.int32)
    return (lambda t, i: jnp.take(t, i, axis=axis, mode=mode)), args, f"take {axis=} {mode=}"


def _point_gather(draw, rng):
    """x[i, j] with index arrays on two of x's dims (an index vector of length 2)."""
    shape = [draw(st.sampled_from([1, 3, 4, 7])) for _ in range(draw(st.integers(2, 3)))]
    first, second = sorted(draw(st.permutations(range(len(shape))))[:2])
    ids_shape = (draw(st.sampled_from([1, 2, 5])),)
    mode = draw(st.sampled_from(["fill", "clip"]))
    index = [slice(None)] * len(shape)

    def get(x, i, j):
        index[first], index[second] = i, j
        return x.at[tuple(index)].get(mode=mode)
    args = (rand(rng, *shape), *(rng.randint(-shape[d] - 1, shape[d] + 1, ids_shape).astype(np.int32)
                                 for d in (first, second)))
    return get, args, f"x[i, j] on dims {first, second} {mode=}"


def _vmapped_dynamic_slice(draw, rng):
    b, n, m = (draw(st.sampled_from([1, 3, 4, 8])) for _ in range(3))
    k = draw(st.integers(1, n))
    args = rand(rng, b, n, m), rng.randint(-2, n + 2, (b,)).astype(np.int32)
    return jax.vmap(lambda t, i: jax.lax.dynamic_slice(t, (i, 0), (k, m))), args, f"vmap(dynamic_slice) {k=}"


def _scatter(draw, rng):
    v, m, k = draw(st.sampled_from([3, 5, 8])), draw(st.sampled_from([1, 3, 4])), draw(st.sampled_from([1, 2, 3]))
    op, mode = draw(st.sampled_from(["set", "add", "multiply", "min", "max"])), draw(st.sampled_from(["drop", "clip"]))
    ids = rng.permutation(v + 2)[:k] - (1 if mode == "drop" else 0)    # unique: `set` order is unspecified
    if mode == "clip":
        ids = np.minimum(ids, v - 1)
        ids = rng.permutation(v)[:k] if op == "set" else ids
    batched = draw(st.booleans())
    if batched:   # vmap adds batching dims
        b = draw(st.sampled_from([2, 3]))
        args = rand(rng, b, v, m), np.stack([ids] * b).astype(np.int32), rand(rng, b, k, m)
    else:
        args = rand(rng, v, m), ids.astype(np.int32), rand(rng, k, m)
    scatter = lambda t, i, u: getattr(t.at[i], op)(u, mode=mode)   # noqa: E731
    return (jax.vmap(scatter) if batched else scatter), args, f"scatter {op=} {mode=} {batched=}"


def _iota_rows(draw, rng):
    """x[arange(n)[:, None], i], x.at[arange(n), i].add(u), x[arange(n)] + u: an iota
    indexes the rows."""
    n, m, k = draw(st.sampled_from([1, 3, 4, 8])), draw(st.sampled_from([1, 5])), draw(st.sampled_from([1, 3]))
    form = draw(st.sampled_from(["gather", "scatter", "rows"]))
    if form == "scatter":
        args = rand(rng, n, m), rng.randint(-m, m, (n,)).astype(np.int32), rand(rng, n)
        return (lambda x, i, u: x.at[jnp.arange(n), i].add(u)), args, "x.at[arange, i].add(u)"
    if form == "rows":
        return (lambda x, u: x[jnp.arange(n)] + u), (rand(rng, n, m), rand(rng, n, m)), "x[arange] + u"
    args = rand(rng, n, m), rng.randint(-m, m, (n, k)).astype(np.int32)
    return (lambda x, i: x[jnp.arange(n)[:, None], i]), args, "x[arange[:, None], i]"


@st.composite
def gather_scatter_programs(draw):
    mesh = draw(meshes(shapes=[(2, 4), (4, 2), (8,), (2, 2, 2), (3,), (3, 2)]))
    rng = np.random.RandomState(draw(st.integers(0, 2**31 - 1)))
    fn, args, what = draw(st.sampled_from([_take_along_axis, _take, _point_gather, _vmapped_dynamic_slice, _scatter,
                                          _iota_rows]))(draw, rng)
    maps = [draw(dims_mappings(mesh, a.ndim)) for a in args]
    differentiate = draw(st.booleans())

    def program(*xs):
        xs = [gspmd.mesh_split(x, mesh, m) for x, m in zip(xs, maps)]
        if differentiate:   # the gradient of a gather is a scatter-add (with the same batching dims)
            return jax.grad(lambda x0: jnp.sum(jnp.nan_to_num(fn(x0, *xs[1:])) ** 2))(xs[0])
        return fn(*xs)
    return program, args, mesh, f"{what}, layouts {maps}, {differentiate=}"


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(gather_scatter_programs())
def test_random_gather_scatter_programs(case):
    program, args, mesh, what = case
    note(what)
    check(program, *args, mesh=mesh)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(gather_scatter_programs())
def test_random_gather_scatter_programs_many(case):
    test_random_gather_scatter_programs.hypothesis.inner_test(case)


@pytest.mark.parametrize("batch", [8, 6])   # 6 over 8 devices: uneven
@pytest.mark.parametrize("pick,update", [
    (lambda table, row: table[row], "dynamic-update-slice"),                             # a dynamic slice
    (lambda table, row: table[jnp.stack([row, (row + 2) % 5])], "scatter")])             # a gather
def test_a_loop_accumulating_gradients_of_rows_updates_the_accumulator(pick, update, batch):
    """A scan that reads one row of a table per step: the table's gradient is an update
    of zeros per step, folded into the accumulator (no add over the whole table each
    step), and the data-parallel reduction still runs once, after the loop."""
    def step(table, rows, xs):
        xs = gspmd.mesh_split(xs, MESH, [-1, ("x", "y"), -1])

        def loss(table):
            def body(total, inputs):
                row, x = inputs
                return total + jnp.sum(jnp.tanh(x[:, None] * pick(table, row)) ** 2), None
            return jax.lax.scan(body, 0.0, (rows, xs))[0]
        return table - 0.1 * jax.grad(loss)(table)

    rng = np.random.RandomState(3)
    table, rows, xs = rand(rng, 5, 6), np.array([4, 0, 4, 2, 1, 3], np.int32), rand(rng, 6, batch, 6)
    low = check(step, table, rows, xs, mesh=MESH)
    bodies = [sub for i in low.spmd.instrs for sub, _ in gspmd.ops.runs(i)]
    table_shape = tuple(low.spmd.params[0].shape)
    assert not [i for body in bodies for i in body.instrs if i.opcode == "add" and i.output.shape == table_shape]
    assert [i for body in bodies for i in body.instrs
            if i.opcode == update and i.operands[0] in body.params and i.output.shape == table_shape]
    reductions = [c for c in low.report().collectives if c.kind == "all-reduce"]
    assert reductions and all(c.executions == 1 for c in reductions), low.report()


# -- index components that are iotas (x[jnp.arange(n), i]): batching dims in disguise ---------
ROWS = 6   # over 8 devices (and over 2 or 4): uneven


def _rows_and_columns(seed: int):
    """x [ROWS, 7], a few columns per row [ROWS, 3] (some negative: jnp wraps them), one
    column per row [ROWS], an update per row [ROWS]."""
    rng = np.random.RandomState(seed)
    cols = rng.randint(-7, 7, (ROWS, 3)).astype(np.int32)
    return rand(rng, ROWS, 7), cols, cols[:, 0].copy(), rand(rng, ROWS)


ROW_PICKS = {
    "x[arange[:, None], i]": lambda x, i: x[jnp.arange(ROWS)[:, None], i],
    "x[arange, i]": lambda x, i: x[jnp.arange(ROWS), i[:, 0]],
}


def _split_rows(x_map):
    return gspmd.Sharding.from_mesh(MESH, x_map, (ROWS, 7)).tiles[0]


@pytest.mark.parametrize("x_map", [[("x", "y"), -1], ["x", -1]])
@pytest.mark.parametrize("pick", list(ROW_PICKS))
def test_rows_picked_through_an_iota_are_gathered_where_they_are(pick, x_map):
    """jnp indexes each row by its own position through an iota component of the indices:
    each device gathers from its own rows, nothing moves, the batch stays split."""
    x, cols, _, _ = _rows_and_columns(11)
    low = check(lambda x, i: ROW_PICKS[pick](gspmd.mesh_split(x, MESH, x_map), i), x, cols, mesh=MESH)
    assert low.report().collectives == [], str(low.report())
    assert low.sharding_of("i").tiles[0] == low.sharding_of("result").tiles[0] == _split_rows(x_map)


def test_rows_picked_through_an_iota_from_a_column_split_table_sum_the_result_only():
    """Rows split over x, the picked dim over y: each device answers for its columns, one
    all-reduce over y of its [3, 3] share of the result; the table stays put."""
    x, cols, _, _ = _rows_and_columns(12)
    low = check(lambda x, i: gspmd.mesh_split(x, MESH, ["x", "y"])[jnp.arange(ROWS)[:, None], i], x, cols, mesh=MESH)
    (c,) = low.report().collectives
    assert c.kind == "all-reduce" and c.bytes == 3 * 3 * 4 and set(c.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert low.sharding_of("result") == gspmd.Sharding.from_mesh(MESH, ["x", -1], (ROWS, 3))


@pytest.mark.parametrize("op", ["add", "set"])
def test_rows_updated_through_an_iota_are_scattered_where_they_are(op):
    x, _, col, u = _rows_and_columns(13)
    low = check(lambda x, i, u: getattr(gspmd.mesh_split(x, MESH, [("x", "y"), -1]).at[jnp.arange(ROWS), i], op)(u),
                x, col, u, mesh=MESH)
    assert low.report().collectives == [], str(low.report())
    rows = gspmd.Sharding.from_mesh(MESH, [("x", "y")], (ROWS,))
    assert low.sharding_of("i") == low.sharding_of("u") == rows


def test_gradient_of_rows_picked_through_an_iota_stays_where_the_rows_are():
    """The gradient of the gather is a scatter-add through the same iota: no collective."""
    x, cols, _, _ = _rows_and_columns(14)

    def grad(x, i):
        return jax.grad(lambda x: jnp.sum(jnp.tanh(gspmd.mesh_split(x, MESH, ["x", -1])[jnp.arange(ROWS)[:, None], i])
                                          ** 2))(x)
    low = check(grad, x, cols, mesh=MESH)
    assert low.report().collectives == [], str(low.report())
    assert low.sharding_of("result") == gspmd.Sharding.from_mesh(MESH, ["x", -1], x.shape)
    outside = jax.grad(gspmd.jit(lambda x, i: jnp.sum(gspmd.mesh_split(x, MESH, ["x", -1])[jnp.arange(ROWS), i] ** 2),
                                 mesh=MESH))
    expected = jax.grad(lambda x: jnp.sum(x[jnp.arange(ROWS), cols[:, 0]] ** 2))(x)
    np.testing.assert_allclose(outside(x, cols[:, 0]), expected, rtol=1e-6)


@pytest.mark.parametrize("scatter", [False, True])
def test_rows_indexed_through_an_iota_take_their_split_from_the_indices(scatter):
    """The batch split written on the indices splits the operand's rows alike."""
    x, _, col, u = _rows_and_columns(15)

    def f(x, i, u):
        i = gspmd.mesh_split(i, MESH, ["x"])
        return x.at[jnp.arange(ROWS), i].add(u) if scatter else x[jnp.arange(ROWS), i]
    low = check(f, x, col, u, mesh=MESH)
    assert low.report().collectives == [], str(low.report())
    assert low.sharding_of("x").tiles[0] == low.sharding_of("result").tiles[0] == 2


ALL_IOTA = {
    "x[arange]": lambda x, u: x[jnp.arange(ROWS)],
    "x[arange[:, None], arange[None, :]]": lambda x, u: x[jnp.arange(ROWS)[:, None], jnp.arange(7)[None, :]],
    "x.at[arange].add(u)": lambda x, u: x.at[jnp.arange(ROWS)].add(u),
    "grad of x[arange], fill": lambda x, u: jax.grad(lambda x: jnp.sum(x.at[jnp.arange(ROWS)].get(mode="fill") * u))(x),
}


@pytest.mark.parametrize("what", list(ALL_IOTA))
def test_indices_that_are_iotas_only_move_nothing(what):
    """Every index component an iota: every indexed dim a batching dim, the index vector
    empty; the rows stay where they are (they were summed over the devices before)."""
    rng = np.random.RandomState(18)
    x, u = rand(rng, ROWS, 7), rand(rng, ROWS, 7)
    low = check(lambda x, u: ALL_IOTA[what](gspmd.mesh_split(x, MESH, [("x", "y"), -1]), u), x, u, mesh=MESH)
    assert low.report().collectives == [], str(low.report())


@pytest.mark.parametrize("what,fn", [
    ("an iota shorter than the rows", lambda x, i: x[jnp.arange(ROWS - 2)[:, None], i[:ROWS - 2]]),
    ("the diagonal", lambda x, i: x[jnp.arange(ROWS), jnp.arange(ROWS)] + i[:, 0]),
    ("an iota on the second dim", lambda x, i: x.T[i[:, 0], jnp.arange(ROWS)]),
    ("under vmap", lambda x, i: jax.vmap(lambda x, i: x[jnp.arange(2)[:, None], i])(x.reshape(3, 2, 7),
                                                                                        i.reshape(3, 2, 3))),
    ("an iota along another dim", lambda x, i: x[jnp.arange(3)[None, :], i]),
])
def test_other_iotas_in_the_indices_gather_alike(what, fn):
    """Iotas that are not a batch dim's own positions stay index components; vmap's
    batching dims and the iota's together."""
    x, cols, _, _ = _rows_and_columns(16)
    check(lambda x, i: fn(gspmd.mesh_split(x, MESH, ["x", "y"]), i), x, cols, mesh=MESH)


def test_an_iota_that_rounds_is_no_batch_dim():
    """A bfloat16 iota rounds past 256: the positions it gives are not the rows' own."""
    rng = np.random.RandomState(17)
    x, col = rand(rng, 300, 3), rng.randint(0, 3, (300,)).astype(np.int32)

    def f(x, i):
        return gspmd.mesh_split(x, MESH, [("x", "y"), -1])[jnp.arange(300, dtype=jnp.bfloat16).astype(jnp.int32), i]
    low = check(f, x, col, mesh=MESH)
    assert not [i for i in low.program.instrs if i.opcode == "gather" and i.attrs["operand_batching_dims"]]


def test_an_iota_inside_a_stacked_index_array_is_cut_out():
    """lax.gather on indices the user stacked (the iota shares a concatenate piece with
    another column, through a reshape): the iota column is sliced away, the rows stay."""
    rng = np.random.RandomState(19)
    x = rand(rng, ROWS, 5, 4)
    i, j = rng.randint(0, 5, (ROWS,)).astype(np.int32), rng.randint(0, 4, (ROWS,)).astype(np.int32)
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0, 1, 2), start_index_map=(0, 1, 2))

    def f(x, i, j):
        idx = jnp.concatenate([jnp.stack([jnp.arange(ROWS), i], -1).reshape(ROWS, 2), j[:, None]], -1)
        return jax.lax.gather(gspmd.mesh_split(x, MESH, [("x", "y"), -1, -1]), idx, dn, (1, 1, 1))
    low = check(f, x, i, j, mesh=MESH)
    assert low.report().collectives == [], str(low.report())
    assert low.sharding_of("result") == gspmd.Sharding.from_mesh(MESH, [("x", "y")], (ROWS,))


def _rows_cut_at(a, k):
    """Each row's 6 elements from k, k out of range (clipped): vmap makes it a gather."""
    return jax.vmap(lambda r: jax.lax.dynamic_slice_in_dim(r, k, 6, 0))(a)


@pytest.mark.xfail(jax.__version_info__ < (0, 12), strict=True,
                   reason="XLA:CPU folds a dynamic slice of a clipping gather into the gather and clamps the summed "
                          "start against the slice (jaxlib 0.10.2; fixed by 0.12.1)")
def test_xla_clamps_a_sliced_clipping_gather_against_the_slice():
    """Found by the fuzzer (seed 96298, shrunk; NumPy inputs): jax.jit gives [6, 13]
    where eager jax gives [1, 8]. A partitioned program slices each device's columns out
    of such a gather: the jax backend clamps clipping starts itself."""
    f = lambda a, k, j: jax.lax.dynamic_slice_in_dim(_rows_cut_at(a, k), j, 1, 1)
    a = np.arange(14, dtype=np.float32).reshape(2, 7)
    np.testing.assert_array_equal(jax.jit(f)(a, np.int32(8), np.int32(0)), f(a, np.int32(8), np.int32(0)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("devices", [6, 4])   # 6 columns split evenly, then 2, 2, 2, 0
def test_a_clipping_gather_split_over_the_devices(backend, devices):
    mesh = gspmd.Mesh(np.arange(devices).reshape(-1, 2), ("x", "y"))
    f = lambda a, k: gspmd.mesh_split(_rows_cut_at(a, k), mesh, [None, ("y", "x")])
    a = np.arange(14, dtype=np.float32).reshape(2, 7)
    for k in (8, 1, 0, -3):
        np.testing.assert_array_equal(gspmd.jit(f, mesh=mesh, backend=backend)(a, np.int32(k)),
                                      _rows_cut_at(a, np.int32(k)))
