"""Code annotated for jax.jit runs unchanged inside gspmd.jit: with_sharding_constraint
(NamedSharding, or a PartitionSpec under a context mesh), Flax logical constraints, a
nested jax.jit with in/out shardings and jax.shard_map mean what the equivalent
mesh_split / gspmd.manual annotations mean, down to the collectives they imply."""
from collections import Counter
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh as JaxMesh
from jax.sharding import NamedSharding, PartitionSpec as P

import gspmd
from gspmd import planning
from util import check, rand


def jax_mesh(shape, names, permuted=False) -> JaxMesh:
    order = np.random.RandomState(7).permutation(8) if permuted else np.arange(8)
    return JaxMesh(np.array(jax.devices()[:8], dtype=object)[order].reshape(shape), names)


JMESH = jax_mesh((2, 4), ("data", "model"))
GMESH = gspmd.Mesh.from_jax(JMESH)


def collectives(low: gspmd.Lowered) -> list:
    """(kind, bytes, groups) of each collective: what two annotations must agree on."""
    return sorted((c.kind, c.bytes, np.asarray(c.groups).tolist()) for c in low.report().collectives)


# -- the same train step, annotated four ways ------------------------------------------------
def train_step(split: Callable) -> Callable:
    """A Megatron MLP train step annotated through split(x, dims) (a mesh axis or None
    per dim): batch on "data", hidden on "model"."""
    def loss(params, x, y):
        w1, w2 = split(params["w1"], (None, "model")), split(params["w2"], ("model", None))
        h = split(jax.nn.gelu(split(x, ("data", None)) @ w1), ("data", "model"))
        return jnp.mean((h @ w2 - y) ** 2)

    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss(params, x, y)
    return step


def by_mesh_split(mesh: gspmd.Mesh):
    return lambda x, dims: gspmd.mesh_split(x, mesh, list(dims))


def by_named_sharding(mesh: JaxMesh):
    return lambda x, dims: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*dims)))


def by_partition_spec(x, dims):
    return jax.lax.with_sharding_constraint(x, P(*dims))


def mlp_inputs(batch=6, d=10, hidden=12, out=3):
    rng = np.random.RandomState(0)   # uneven: 10 and 3 do not divide the mesh
    return {"w1": rand(rng, d, hidden), "w2": rand(rng, hidden, out)}, rand(rng, batch, d), rand(rng, batch, out)


@pytest.mark.parametrize("permuted", [False, True])
def test_named_sharding_constraints_equal_mesh_split(permuted):
    jmesh = jax_mesh((2, 4), ("data", "model"), permuted)
    gmesh = gspmd.Mesh.from_jax(jmesh)
    assert gmesh.devices.ravel().tolist() == [jax.devices().index(d) for d in jmesh.devices.flat]
    args = mlp_inputs()
    low = check(train_step(by_named_sharding(jmesh)), *args)
    assert collectives(low) == collectives(gspmd.jit(train_step(by_mesh_split(gmesh))).lower(*args))
    assert low.report().counts()["all-reduce"] >= 1   # Megatron's partial sums, data-parallel gradients


def test_partition_spec_under_jax_set_mesh():
    args = mlp_inputs()
    with jax.set_mesh(JMESH):
        low = check(train_step(by_partition_spec), *args)
    assert collectives(low) == collectives(gspmd.jit(train_step(by_mesh_split(GMESH))).lower(*args))


def test_reshard_that_jnp_emits_under_an_abstract_mesh_changes_nothing():
    def f(x):   # jnp.where reshards its operands to P(None, None) under an abstract context mesh
        return jnp.where(gspmd.mesh_split(x, GMESH, ["data", "model"]) > 0, x, 0.0)

    x = rand(np.random.RandomState(9), 4, 8)
    with jax.sharding.use_abstract_mesh(JMESH.abstract_mesh):
        assert "reshard" in str(jax.make_jaxpr(f)(x))
    low = check(f, x, mesh=GMESH)   # gspmd.jit(mesh=...) traces under that mesh's abstract mesh
    assert [i.opcode for i in low.program.instrs].count("sharding") == 1
    assert low.report().counts() == {}


def test_partition_spec_refers_to_gspmd_jit_mesh():
    args = mlp_inputs()
    with jax.set_mesh(JMESH):
        expected = jax.jit(train_step(by_partition_spec))(*args)
    step = gspmd.jit(train_step(by_partition_spec), mesh=GMESH)
    jax.tree_util.tree_map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5), step(*args), expected)
    assert collectives(step.lower(*args)) == collectives(gspmd.jit(train_step(by_mesh_split(GMESH))).lower(*args))


def test_context_mesh_is_part_of_the_cache_key():
    """The same function under two context meshes (other device orders) lowers twice."""
    fn = gspmd.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, P("data", "model")))
    x = np.ones((4, 8), np.float32)
    layouts = []
    for permuted in (False, True):
        with jax.set_mesh(jax_mesh((2, 4), ("data", "model"), permuted)):
            layouts.append(fn.lower(x).sharding_of(0))
    assert layouts[0] != layouts[1]


def test_unconstrained_dims_are_left_to_propagation():
    def f(x, w):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(JMESH, P("data", P.UNCONSTRAINED)))
        w = jax.lax.with_sharding_constraint(w, NamedSharding(JMESH, P(None, "model")))
        return jax.vmap(lambda r: jax.lax.with_sharding_constraint(r, NamedSharding(JMESH, P("model"))))(x @ w)

    rng = np.random.RandomState(1)
    low = check(f, rand(rng, 6, 8), rand(rng, 8, 12))
    assert low.program.params[0].sharding == gspmd.Sharding.from_mesh(GMESH, ["data", -1], (6, 8))
    assert low.report().counts() == {}


# -- Flax: logical axis rules ------------------------------------------------------------------
class LogicalMLP(nn.Module):
    """Parameters and activations named by logical axes; `constrain` applies them."""
    constrain: Callable
    logical_params: bool

    @nn.compact
    def __call__(self, x):
        def param(name, shape, axes):
            init = nn.initializers.lecun_normal()
            if self.logical_params:   # MaxText's way: the initializer carries the names
                return self.param(name, nn.with_logical_partitioning(init, axes), shape)
            return self.constrain(self.param(name, init, shape), axes)
        x = self.constrain(x, ("activation_batch", "activation_embed"))
        h = jax.nn.gelu(x @ param("w1", (x.shape[-1], 12), ("embed", "mlp")))
        h = self.constrain(h, ("activation_batch", "activation_mlp"))
        return h @ param("w2", (12, x.shape[-1]), ("mlp", "embed"))


def _logical_step(model: nn.Module, rules) -> Callable:
    def step(params, x):
        def loss(p):
            return jnp.mean(model.apply(p, x) ** 2)
        with nn.logical_axis_rules(rules):
            grads = jax.grad(loss)(params)
            return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss(params)
    return step


def _by_rules(mesh: gspmd.Mesh, rules):
    table = dict(rules)
    return lambda x, axes: gspmd.mesh_split(x, mesh, [table.get(a) for a in axes])


# MaxText-style: the batch over two axes (data and fsdp), weights fsdp-sharded
MAXTEXT_RULES = (("activation_batch", ("data", "fsdp")), ("activation_mlp", "tensor"), ("embed", "fsdp"),
                 ("mlp", "tensor"))


@pytest.mark.parametrize("shape,rules", [
    ((2, 4), (("activation_batch", "data"), ("activation_mlp", "model"), ("mlp", "model"))),
    ((2, 2, 2), MAXTEXT_RULES),
])
def test_flax_logical_constraints_equal_mesh_split(shape, rules):
    names = ("data", "model") if len(shape) == 2 else ("data", "fsdp", "tensor")
    gmesh = gspmd.Mesh.from_jax(jax_mesh(shape, names))
    flax_model = LogicalMLP(nn.with_logical_constraint, logical_params=True)
    x = rand(np.random.RandomState(2), 8, 6)
    params = flax_model.init(jax.random.PRNGKey(0), x)   # boxed: apply constrains them as it unboxes
    low = check(_logical_step(flax_model, rules), params, x, mesh=gmesh)
    by_hand = gspmd.jit(_logical_step(LogicalMLP(_by_rules(gmesh, rules), logical_params=False), rules), mesh=gmesh)
    assert collectives(low) == collectives(by_hand.lower(nn.meta.unbox(params), x))
    assert any(s.num_devices == 8 and not s.is_replicated for s in (p.sharding for p in low.program.params))


def test_maxtext_style_jit_with_shardings_from_logical_rules():
    """The step jitted with in/out shardings derived from the parameters' logical names,
    called inside gspmd.jit: the parameters arrive in those layouts."""
    jmesh = jax_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    model = LogicalMLP(nn.with_logical_constraint, logical_params=True)
    x = rand(np.random.RandomState(3), 8, 6)
    boxed = model.init(jax.random.PRNGKey(0), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), jmesh, MAXTEXT_RULES)
    step = jax.jit(_logical_step(model, MAXTEXT_RULES), in_shardings=(shardings, NamedSharding(jmesh, P(("data", "fsdp")))),
                   out_shardings=(shardings, NamedSharding(jmesh, P())))
    low = check(step, nn.meta.unbox(boxed), x, mesh=gspmd.Mesh.from_jax(jmesh))
    w1 = low.program.params[0]   # params/w1: (embed, mlp) -> (fsdp, tensor)
    assert w1.sharding == gspmd.Sharding.from_mesh(gspmd.Mesh.from_jax(jmesh), ["fsdp", "tensor"], w1.shape)


# -- nested jax.jit with shardings -------------------------------------------------------------
def test_nested_jit_shardings_are_annotations():
    def inner(x, w):
        return jnp.tanh(x @ w)

    def annotated_jit(x, w):
        f = jax.jit(inner, in_shardings=(NamedSharding(JMESH, P("data")), NamedSharding(JMESH, P(None, "model"))),
                    out_shardings=NamedSharding(JMESH, P("data", "model")))
        return f(x, w) * 2

    def annotated_by_hand(x, w):
        y = inner(gspmd.mesh_split(x, GMESH, ["data", None]), gspmd.mesh_split(w, GMESH, [None, "model"]))
        return gspmd.mesh_split(y, GMESH, ["data", "model"]) * 2

    rng = np.random.RandomState(3)
    args = rand(rng, 6, 8), rand(rng, 8, 12)   # jax.jit's shardings must divide evenly
    low = check(annotated_jit, *args)
    assert collectives(low) == collectives(gspmd.jit(annotated_by_hand).lower(*args)) == []

    def partly_annotated(x, w):   # shardings given for one argument only, as a bare spec
        return jax.jit(inner, in_shardings=(P("data"), None))(x, w)

    with jax.set_mesh(JMESH):
        low = check(partly_annotated, *args)
    assert low.program.params[0].sharding == gspmd.Sharding.from_mesh(GMESH, ["data", -1], (6, 8))


# -- jax.shard_map inside ----------------------------------------------------------------------
def megatron_body(a, w):
    return jax.lax.psum(a @ w, "model")


@pytest.mark.parametrize("check_vma", [False, True])
def test_shard_map_equals_gspmd_manual(check_vma):
    def with_shard_map(a, w, bias):
        a = jax.lax.with_sharding_constraint(a, NamedSharding(JMESH, P("data")))
        y = jax.shard_map(megatron_body, mesh=JMESH, in_specs=(P("data", "model"), P("model")), out_specs=P("data"),
                          check_vma=check_vma)(a, w)
        return jnp.tanh(y + bias)

    def with_manual(a, w, bias):
        a = gspmd.mesh_split(a, GMESH, ["data", -1])
        y = gspmd.manual(megatron_body, GMESH, in_specs=[["data", "model"], ["model", -1]],
                         out_specs=["data", -1])(a, w)
        return jnp.tanh(y + bias)

    rng = np.random.RandomState(4)
    args = rand(rng, 6, 8), rand(rng, 8, 5), rand(rng, 5)
    low = check(with_shard_map, *args)
    assert collectives(low) == collectives(gspmd.jit(with_manual).lower(*args))
    assert [c.kind for c in low.report().collectives].count("all-reduce") == 1   # the psum, nothing added


def test_shard_map_fsdp_all_gather_on_a_1d_mesh():
    """Weights split over all 8 devices, gathered inside the body (FSDP)."""
    mesh = jax_mesh((8,), ("fsdp",))

    def body(x, w):
        w = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)
        return jax.nn.relu(x @ w), jax.lax.pmax(jnp.max(x), "fsdp")

    def f(x, w):
        y, m = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=(P("fsdp"), P()))(x, w)
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("fsdp"))), m

    rng = np.random.RandomState(5)
    low = check(f, rand(rng, 16, 24), rand(rng, 24, 6))
    assert low.report().counts() == {"all-gather": 1, "all-reduce": 1}   # the body's, nothing added


def test_shard_map_with_the_context_mesh_and_named_collectives():
    def body(a):
        i = jax.lax.axis_index("model").astype(a.dtype)
        return (jax.lax.pmax(a, "data") + i, jax.lax.psum_scatter(a, "model", scatter_dimension=1, tiled=True),
                jax.lax.ppermute(a, "model", [(j, (j + 1) % 4) for j in range(4)]),
                jax.lax.all_to_all(a, "model", 1, 0, tiled=True), jax.lax.psum(a, ("data", "model")))

    f = jax.shard_map(body, in_specs=P("data", "model"),
                      out_specs=(P(None, "model"), P("data", "model"), P("data", "model"), P("data", "model"), P()))
    with jax.set_mesh(JMESH):
        low = check(f, rand(np.random.RandomState(6), 4, 16))
    # The body's own collectives; nothing annotates the program's outputs, so they are
    # gathered after the region (layouts named only by a manual region's specs do not
    # propagate beyond it).
    in_body = Counter(c.kind for c in low.report().collectives if "[manual:" in c.origin)
    assert in_body == {"all-reduce": 2, "reduce-scatter": 1, "collective-permute": 1, "all-to-all": 1}


def test_partially_manual_shard_map():
    """Manual over "model" only: the body is replicated over "data" (the automatic axis)."""
    f = jax.shard_map(lambda v: jax.lax.psum(v.sum(0, keepdims=True), "model"), mesh=JMESH, in_specs=P(None, "model"),
                      out_specs=P(), axis_names={"model"})

    def g(a):
        return f(jax.lax.with_sharding_constraint(a, NamedSharding(JMESH, P("data")))) * 2

    low = check(g, rand(np.random.RandomState(7), 6, 16))
    assert low.report().counts()["all-reduce"] == 1


def test_gradient_through_shard_map():
    f = jax.shard_map(megatron_body, mesh=JMESH, in_specs=(P("data", "model"), P("model")), out_specs=P("data"))

    def step(a, w):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(f(a, w)) ** 2))(w)

    rng = np.random.RandomState(8)
    check(step, rand(rng, 6, 8), rand(rng, 8, 5))


EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))   # Explicit axes


@pytest.mark.parametrize("axes", ["data", ("data", "model")])
@pytest.mark.parametrize("jit_mesh", ["same", "gspmd", "other types", "none"])
@pytest.mark.parametrize("mesh", [JMESH, EXPLICIT], ids=["Auto", "Explicit"])
def test_shard_map_given_a_concrete_jax_mesh_runs_as_under_jax_jit(mesh, jit_mesh, axes):
    """shard_map(mesh=<a jax.sharding.Mesh>) with a psum inside gspmd.jit, whatever mesh
    gspmd.jit is given: the same, a gspmd.Mesh of those axes (its context mesh is that of
    a jax mesh over the same devices), one of the other axis types (traced as jax.jit
    traces it, without a context mesh), none. The argument is laid out over the mesh,
    as jax.make_mesh's Explicit axes need for a shard_map under jax.jit; its type keeps
    that layout here too."""
    out_specs = P(None, "model") if axes == "data" else P()
    body = jax.shard_map(lambda b: jax.lax.psum(b, axes), mesh=mesh, in_specs=P("data", "model"), out_specs=out_specs)

    def f(a):
        return jnp.tanh(body(a * 2))

    jit_mesh = {"same": mesh, "gspmd": gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model")),
                "other types": EXPLICIT if mesh is JMESH else JMESH, "none": None}[jit_mesh]
    x = jax.device_put(rand(np.random.RandomState(9), 6, 16), NamedSharding(mesh, P("data", "model")))
    low = check(f, x, mesh=jit_mesh)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    groups = ids.T if axes == "data" else ids.reshape(1, -1)
    (psum,) = [c for c in low.report().collectives if "[manual:" in c.origin]
    assert psum.kind == "all-reduce" and sorted(map(sorted, psum.groups)) == sorted(map(sorted, groups.tolist()))


# -- meshes without this process's devices: planning -------------------------------------------
def test_named_shardings_over_an_abstract_mesh_are_over_the_jits_mesh():
    """Abstract inputs built without devices (MaxText's for ahead-of-time compilation)
    are laid out over gspmd.jit(mesh=...), whose axes they name."""
    abstract = JMESH.abstract_mesh
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(abstract, P("data")))
    low = gspmd.jit(lambda v: jax.lax.with_sharding_constraint(v * 2, NamedSharding(abstract, P(None, "model"))),
                    mesh=GMESH).lower(x)
    assert low.sharding_of(0) == gspmd.Sharding.from_mesh(GMESH, P(None, "model"), (8, 16))
    # the argument's split dim kept, its whole one left to propagation (which splits it as the constraint)
    assert low.sharding_of("v") == gspmd.Sharding.from_mesh(GMESH, P("data", "model"), (8, 16))
    with pytest.raises(gspmd.ShardingError, match="no mesh with these axes"):
        gspmd.jit(lambda v: v * 2, mesh=gspmd.Mesh(np.arange(8).reshape(4, 2), ("data", "model"))).lower(x)


def test_a_mesh_of_stand_in_devices_plans_but_does_not_run():
    """256 devices this process has not, as MaxText's abstract train state names them:
    ShapeDtypeStructs with NamedShardings over a jax mesh of stand-in devices (and
    constraints over it inside) lower and report; the jax backend refuses to run them."""
    mesh = planning.stand_in_mesh((64, 4), ("data", "model"), "tpu-v5p")
    x = jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))

    def f(x, w):
        return jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("data", None))).sum()
    low = gspmd.jit(f, backend="jax").lower(x, w)
    assert low.num_devices == 256 and low.mesh == gspmd.Mesh.from_jax(mesh)
    assert Counter(c.kind for c in low.report().collectives) == {"all-gather": 1, "all-reduce": 1}
    with pytest.raises(gspmd.ShardingError, match="for planning"):
        gspmd.jit(f, backend="jax")(np.ones(x.shape, np.float32), np.ones(w.shape, np.float32))
    with pytest.raises(gspmd.ShardingError, match="not among jax.devices"):
        gspmd.Mesh(np.array(jax.devices()[:1] + planning.stand_in_devices(2)[1:], dtype=object), ("d",))


# -- errors ------------------------------------------------------------------------------------
def test_unknown_meshes_and_shardings_raise():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(gspmd.ShardingError, match="abstract mesh has no device order"):
        gspmd.Mesh.from_jax(jax.sharding.AbstractMesh((2, 4), ("a", "b")))
    with pytest.raises(gspmd.ShardingError, match="NamedSharding"):
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        gspmd.jit(lambda v: jax.lax.with_sharding_constraint(v, one_device)).lower(x)
    auto = (jax.sharding.AxisType.Auto,) * 2   # (jax 0.12's default is Explicit)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 4), ("a", "b"), axis_types=auto)):
        with pytest.raises(gspmd.ShardingError, match="jax.set_mesh"):
            gspmd.jit(lambda v: jax.lax.with_sharding_constraint(v, P("a"))).lower(x)
