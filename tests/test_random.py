"""Randomness: jax.random under gspmd.jit gives the bits of one device (jax.jit) while each
device hashes only the counters of its own shard, with raw uint32 and typed keys, keys as
arguments and results, split/fold_in chains, inside scan, and in Flax and Equinox dropout.
Randomness never adds a collective. Keys of the rbg PRNGs give one device's bits too."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from gspmd.ops.random import threefry2x32
from strategies import MESH_SHAPES, dims_mappings, meshes
from util import BACKENDS, assert_same

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
SMALL_MESHES = [s for s in MESH_SHAPES if math.prod(s) <= 8]   # the jax backend has 8 devices
KEYS = {"raw": lambda seed: jax.random.PRNGKey(seed), "typed": lambda seed: jax.random.key(seed)}


def split(x, *dims, mesh=MESH):
    return gspmd.mesh_split(x, mesh, list(dims))


# The sim backend computes floats with NumPy, one op at a time, where XLA fuses (a*b+c as
# one FMA) and has its own log: float results agree to the last bits, the random bits,
# integers and masks exactly. The jax backend runs XLA like jax.jit: bit for bit.
SIM_RTOL, SIM_ATOL = 1e-5, 1e-6


def check_same(fn, *args, mesh=MESH, backends=BACKENDS, reassociates=False, shape_dependent=False) -> gspmd.Lowered:
    """fn partitioned on each backend equals jax.jit(fn) (see SIM_RTOL); returns the Lowered.
    reassociates: fn sums over split dims (partial sums add up in another order), so its
    floats agree to SIM_RTOL on the jax backend too. shape_dependent: the same, where an
    XLA kernel rounds differently at the shards' shape than at the whole array's."""
    expected = jax.jit(fn)(*args)
    for backend in backends:
        tolerance = (SIM_RTOL, SIM_ATOL) if backend == "sim" or reassociates or shape_dependent else (0.0, 0.0)
        assert_same(gspmd.jit(fn, mesh=mesh, backend=backend)(*args), expected, *tolerance)
    return gspmd.jit(fn, mesh=mesh).lower(*args)


def test_threefry_reference_is_jax_threefry():
    from jax.extend.random import threefry2x32_p
    words = [np.random.RandomState(s).randint(0, 2 ** 32, (4, 33), dtype=np.uint64).astype(np.uint32)
             for s in range(4)]
    for got, want in zip(threefry2x32(*words), threefry2x32_p.bind(*words)):
        np.testing.assert_array_equal(got, np.asarray(want))


# -- every distribution, randomized layouts ----------------------------------------------
SAMPLERS = {
    "bits": lambda k, s: jax.random.bits(k, s),
    "bits8": lambda k, s: jax.random.bits(k, s, jnp.uint8),
    "bits16": lambda k, s: jax.random.bits(k, s, jnp.uint16),
    "uniform": lambda k, s: jax.random.uniform(k, s, minval=-2.0, maxval=3.0),
    "uniform-bf16": lambda k, s: jax.random.uniform(k, s, jnp.bfloat16),
    "normal": lambda k, s: jax.random.normal(k, s),
    "bernoulli": lambda k, s: jax.random.bernoulli(k, 0.3, s),
    "randint": lambda k, s: jax.random.randint(k, s, -5, 17),
    "truncated-normal": lambda k, s: jax.random.truncated_normal(k, -1.5, 2.0, s),
    "gumbel": lambda k, s: jax.random.gumbel(k, s),
    "categorical": lambda k, s: jax.random.categorical(k, jnp.linspace(-1.0, 1.0, 7), shape=s),
    "glorot": lambda k, s: jax.nn.initializers.glorot_uniform()(k, s),
}


@st.composite
def sampler_cases(draw):
    mesh = draw(meshes(SMALL_MESHES))
    shape = tuple(draw(st.lists(st.integers(1, 11), min_size=2, max_size=3)))
    return (draw(st.sampled_from(sorted(SAMPLERS))), draw(st.sampled_from(sorted(KEYS))), draw(st.integers(0, 2 ** 31 - 1)),
            mesh, shape, draw(dims_mappings(mesh, len(shape))))


def run_sampler_case(case):
    name, key_kind, seed, mesh, shape, dims = case
    sample = SAMPLERS[name]
    low = check_same(lambda k: split(sample(k, shape), *dims, mesh=mesh), KEYS[key_kind](seed), mesh=mesh)
    assert low.report().collectives == [], low.as_text()


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_each_sampler_split_unevenly(name):
    key_kind = sorted(KEYS)[sorted(SAMPLERS).index(name) % 2]   # both kinds, half the time
    run_sampler_case((name, key_kind, 7, MESH, (5, 7), ["y", "x"]))


def test_random_samplers_random_layouts():
    given(sampler_cases())(_settings(6)(run_sampler_case))()


@pytest.mark.slow
def test_many_random_samplers_random_layouts():
    given(sampler_cases())(_settings(200)(run_sampler_case))()


def test_permutation_and_choice():
    def f(key, x):   # sorting by random keys: a permuted split array moves between devices
        return (jax.random.permutation(key, 13), jax.random.choice(key, 13, (5,), replace=False),
                jax.random.permutation(key, split(x, ("x", "y"), -1)))

    check_same(f, jax.random.key(3), np.random.RandomState(0).randn(10, 6).astype(np.float32))


def test_each_device_hashes_only_its_shard():
    low = gspmd.jit(lambda k: split(jax.random.uniform(k, (10, 13)), "x", "y")).lower(jax.random.key(0))
    (hashes,) = [i for i in low.spmd.instrs if i.opcode == "threefry2x32"]
    assert [v.shape for v in hashes.outputs] == [(5, 4)] * 2
    assert low.report().collectives == []


# -- keys: seeds, split and fold_in chains, batched keys, arguments and results -------------
@pytest.mark.parametrize("key_kind", sorted(KEYS))
def test_split_and_fold_in_chain(key_kind):
    def f(key, x):
        x = split(x, "x", "y")
        outs = []
        for i in range(3):
            key, sub = jax.random.split(key)
            key = jax.random.fold_in(key, i * 1000 + 7)
            outs.append(jax.random.uniform(sub, x.shape) * x)
        many = jax.random.split(key, (3, 2))
        return outs, many, jax.random.normal(many[2, 1], (9,)), jax.random.key_data(many)

    check_same(f, KEYS[key_kind](11), np.ones((6, 9), np.float32))


@pytest.mark.parametrize("seed_dtype", [np.int32, np.uint32, np.int8])
def test_seeds_inside_the_function(seed_dtype):
    def f(seed, seeds):
        return (jax.random.bits(jax.random.key(seed), (5,)), jax.random.normal(jax.random.PRNGKey(seed), (3, 4)),
                jax.vmap(jax.random.PRNGKey)(split(seeds, "x")))

    seeds = np.asarray([0, 5, 127, -3 if np.dtype(seed_dtype).kind == "i" else 2 ** 31 + 9], seed_dtype)
    check_same(f, seeds[-1], seeds)


def test_threefry2x32_primitive():
    from jax.extend.random import threefry_2x32
    check_same(lambda key, counts: threefry_2x32(key, split(counts, ("x", "y"))), jax.random.PRNGKey(3),
               np.arange(11, dtype=np.uint32))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=6), st.integers(1, 2 ** 32 - 1),
       st.integers(0, 2 ** 32 - 1))
def test_counters_past_two_to_the_32_in_32_bit_words(xs, factor, addend):
    """Beyond 2**32 random values per key, each value's counter is its 64-bit index as
    (high, low) words, computed in uint32 (no x64): x * factor + addend, as uint64 does."""
    from gspmd.ir import Program
    from gspmd.ops.convert import Conversion
    from gspmd.ops.random import _plus, _times
    from gspmd.runtime import sim
    program = Program()
    b = Conversion(program, inline=None)
    x, extra = (b.param((len(xs),), np.uint32) for _ in range(2))
    program.outputs = list(_plus(b, *_times(b, x, factor), extra))
    xs = np.asarray(xs, np.uint64)
    high, low = sim.evaluate(program, [xs.astype(np.uint32), np.full(len(xs), addend, np.uint32)])
    expected = xs * np.uint64(factor) + np.uint64(addend)
    np.testing.assert_array_equal(high, (expected >> np.uint64(32)).astype(np.uint32))
    np.testing.assert_array_equal(low, (expected & np.uint64(2 ** 32 - 1)).astype(np.uint32))


def test_dropout_past_two_to_the_32_values_plans():
    """A global dropout mask of more than 2**32 values under one key (jax.jit draws it:
    its counters are 64-bit) partitions: each device hashes its shard's counters, the
    high words from the index of the leading dims; 65 rows over X split unevenly."""
    mesh = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))

    def dropout(key, x):
        x = gspmd.mesh_split(x, mesh, ["x", "y", -1, -1])
        return jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x / 0.9, 0)

    x = jax.ShapeDtypeStruct((65, 16, 2048, 2048), jnp.bfloat16)   # over 2**32 values
    low = gspmd.jit(dropout).lower(jax.random.key(0), x)
    (hashed,) = [i for i in low.spmd.instrs if i.opcode == "threefry2x32"]
    assert hashed.outputs[0].shape == (33, 4, 2048, 2048)
    assert not low.report().collectives


def test_typed_keys_as_arguments_and_results():
    def f(keys, key, x):
        keys = split(keys, "x")                 # a key array, split over the devices
        fresh = jax.vmap(lambda k: jax.random.split(k, 3))(keys)
        noise = jax.vmap(lambda k: jax.random.normal(k, (5,)))(keys)
        return fresh, jax.random.fold_in(key, 3), split(x, "x", "y") + noise, keys[::2]

    keys = jax.random.split(jax.random.key(4), 6)
    low = check_same(f, keys, jax.random.key(9), np.zeros((6, 5), np.float32))
    assert low.report().collectives == [], low.as_text()
    abstract = [jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct((), keys.dtype),
                jax.ShapeDtypeStruct((6, 5), np.float32)]
    assert gspmd.jit(f, mesh=MESH).lower(*abstract).program.params[0].shape == (6, 2)   # the key data


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_layouts_of_keys_annotate_their_key_data(impl):
    """A layout given to typed keys (mesh_split, with_sharding_constraint, in/out_shardings)
    lays out their key data, words whole: no key is sliced into its words and stacked
    again around an annotation. Six keys: uneven over "y"."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    named = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))

    def f(keys, key, x, annotate=True):
        if annotate:
            keys = split(jax.lax.with_sharding_constraint(keys, named("y")), "y")
        noise = jax.vmap(lambda k: jax.random.normal(k, (5,)))(keys)
        return keys, jax.random.fold_in(key, 1), split(x, "y", "x") + noise

    args = (jax.random.split(jax.random.key(4, impl=impl), 6), jax.random.key(9, impl=impl),
            np.zeros((6, 5), np.float32))
    layouts = dict(in_shardings=(named("x"), named(), None), out_shardings=(named("x"), named(), None))
    expected = jax.jit(f, **layouts)(*args)
    for backend in BACKENDS:
        assert_same(gspmd.jit(f, mesh=mesh, backend=backend, **layouts)(*args), expected, SIM_RTOL, SIM_ATOL)

    def moves_words(program):
        return sorted(i.opcode for i in program.instrs if i.opcode in ("slice", "reshape", "concatenate"))
    low = gspmd.jit(f, mesh=mesh, **layouts).lower(*args)
    plain = gspmd.jit(functools.partial(f, annotate=False), mesh=mesh).lower(*args)
    assert moves_words(low.program) == moves_words(plain.program), low.as_text()   # the random ops' own
    data = low.program.params[0]
    assert data.shape[0] == 6 and data.sharding.tiles == (2, 1)     # the words dim unsplit


def test_batched_keys_fold_in_and_bits():
    def f(keys, msgs, key):
        keys = split(keys, "y")
        return (jax.vmap(jax.random.fold_in)(keys, msgs), jax.vmap(jax.random.fold_in, (None, 0))(key, msgs),
                jax.vmap(lambda k: jax.random.bits(k, (4, 3)))(keys))

    check_same(f, jax.random.split(jax.random.key(1), 5), np.arange(5, dtype=np.uint32), jax.random.key(2))


def test_closed_over_typed_and_raw_keys():
    typed, raw = jax.random.key(3), jax.random.PRNGKey(3)
    check_same(lambda x: split(x, "x", "y") * jax.random.uniform(typed, x.shape), np.ones((4, 8), np.float32))
    check_same(lambda x: split(x, "x", "y") + jax.random.normal(raw, x.shape), np.ones((4, 8), np.float32))


# -- randomness in loops and dropout -------------------------------------------------------
def dropout(key, x, rate=0.25):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0)


@pytest.mark.parametrize("key_kind", sorted(KEYS))
def test_key_carried_through_scan(key_kind):
    def f(key, x, w):
        x = split(x, "x", "y")

        def step(carry, _):
            key, h = carry
            key, sub = jax.random.split(key)
            h = dropout(sub, jnp.tanh(h @ w))
            return (key, h), h != 0   # the masks, bit for bit

        (key, h), masks = jax.lax.scan(step, (key, x), None, length=3)
        return key, h, masks

    rng = np.random.RandomState(0)
    check_same(f, KEYS[key_kind](2), rng.randn(6, 10).astype(np.float32), rng.randn(10, 10).astype(np.float32),
               reassociates=True)


def test_scan_over_split_keys():
    def f(keys, x):
        x = split(x, "x", "y")
        return jax.lax.scan(lambda h, k: (dropout(k, h), jax.random.bits(k, (2,))), x, keys)

    check_same(f, jax.random.split(jax.random.key(0), 4), np.ones((6, 10), np.float32))


def _mlp(key, x, w1, w2, with_dropout):
    x = split(x, "x", -1)
    w1 = split(w1, -1, "y")
    h = jax.nn.relu(x @ w1)
    if with_dropout:
        h = dropout(key, h)
    return ((h @ w2) ** 2).mean()


def collectives(low: gspmd.Lowered) -> list:
    return [(c.kind, c.bytes, c.groups, c.executions) for c in low.report().collectives]


def test_dropout_on_data_and_model_split_activation_adds_no_collective():
    rng = np.random.RandomState(1)
    args = (jax.random.key(5), rng.randn(8, 12).astype(np.float32), rng.randn(12, 20).astype(np.float32),
            rng.randn(20, 6).astype(np.float32))

    def run(with_dropout):
        step = jax.value_and_grad(lambda w1, w2, key, x: _mlp(key, x, w1, w2, with_dropout), argnums=(0, 1))
        return collectives(check_same(lambda key, x, w1, w2: step(w1, w2, key, x), *args, reassociates=True))

    assert run(True) == run(False)


# -- Flax and Equinox dropout ------------------------------------------------------------------
def test_flax_linen_dropout_train_step():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
            return nn.Dense(4)(h), h

    model = Model()
    x = np.random.RandomState(2).randn(8, 6).astype(np.float32)
    params = model.init(jax.random.key(0), x, False)

    def train_step(train: bool):
        def step(params, x, key):
            def loss(params):
                out, h = model.apply(params, split(x, "x", -1), train, rngs={"dropout": key})
                return (out ** 2).mean(), h != 0

            (value, mask), grads = jax.value_and_grad(loss, has_aux=True)(params)
            return value, mask, grads
        return step

    for key in (jax.random.key(3), jax.random.PRNGKey(3)):
        low = check_same(train_step(True), params, x, key, reassociates=True)
    assert collectives(low) == collectives(gspmd.jit(train_step(False), mesh=MESH).lower(params, x, key))


def test_flax_linen_init_of_split_parameters_is_local():
    nn = pytest.importorskip("flax.linen")
    model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
    x = np.ones((8, 6), np.float32)

    def init(key):   # each device draws only its shard of each kernel (lecun normal)
        params = model.init(key, x)
        return jax.tree_util.tree_map(lambda p: split(p, "x", "y") if p.ndim == 2 else p, params)

    # jax 0.12's XLA:CPU erf_inv (truncated_normal's) differs by 1 ulp between a [16, 4] array and
    # its [8, 1] shards in 4 of 64 elements (jax.jit of erf_inv on the shards alone gives ours).
    low = check_same(init, jax.random.key(0), shape_dependent=jax.__version_info__ >= (0, 12))
    assert low.report().collectives == [], low.as_text()


def test_flax_nnx_dropout_train_step():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.first, self.drop = nnx.Linear(6, 16, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)
            self.last = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            h = self.drop(nnx.relu(self.first(x)))
            return self.last(h), h != 0

    graphdef, params, rngs = nnx.split(Model(nnx.Rngs(0, dropout=1)), nnx.Param, ...)

    def step(params, rngs, x):   # the dropout key and its counter come in and go out
        model = nnx.merge(graphdef, params, rngs)

        def loss(model):
            out, mask = model(split(x, "x", -1))
            return (out ** 2).mean(), mask

        (value, mask), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return value, mask, grads, nnx.state(model, nnx.RngState)

    check_same(step, params, rngs, np.random.RandomState(4).randn(8, 6).astype(np.float32), reassociates=True)


def test_equinox_dropout_train_step():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        first: eqx.nn.Linear
        drop: eqx.nn.Dropout
        last: eqx.nn.Linear

        def __init__(self, key, rate):
            k1, k2 = jax.random.split(key)
            self.first, self.drop, self.last = eqx.nn.Linear(6, 16, key=k1), eqx.nn.Dropout(rate), \
                eqx.nn.Linear(16, 4, key=k2)

        def __call__(self, x, key):
            h = self.drop(jax.nn.relu(self.first(x)), key=key)
            return self.last(h), h != 0

    def train_step(rate: float):
        params, static = eqx.partition(Model(jax.random.key(0), rate), eqx.is_array)

        def step(params, x, key):
            x = split(x, "x", -1)
            keys = jax.random.split(key, x.shape[0])   # one key per example, split like them

            def loss(params):
                out, mask = jax.vmap(eqx.combine(params, static))(x, keys)
                return (out ** 2).mean(), mask

            (value, mask), grads = jax.value_and_grad(loss, has_aux=True)(params)
            return value, mask, grads
        return step, params

    args = (np.random.RandomState(3).randn(8, 6).astype(np.float32), jax.random.key(7))
    step, params = train_step(0.5)
    low = check_same(step, params, *args, reassociates=True)
    step, params = train_step(0.0)
    assert collectives(low) == collectives(gspmd.jit(step, mesh=MESH).lower(params, *args))


# -- the rbg PRNGs (jax.random.key(seed, impl="rbg" or "unsafe_rbg")) --------------------------
@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_rbg_keys_give_the_bits_of_one_device(impl):
    """Keys of XLA's RngBitGenerator: seeded, split (batched), folded, passed in and
    returned, drawing dropout masks, normals and categoricals on a split activation.
    Each device generates all the bits of a draw and keeps its part, as XLA's
    partitioner does, so the values are those of one device."""
    def f(x, key):
        x = split(x, "x", "y")
        k1, k2, k3 = jax.random.split(key, 3)
        keys = jax.random.split(jax.random.fold_in(k3, 5), 4)
        return (jnp.where(jax.random.bernoulli(k1, 0.5, x.shape), x, 0.0), jax.random.normal(k2, x.shape),
                jax.random.categorical(k3, x), jax.vmap(lambda k: jax.random.uniform(k, (3,)))(keys), keys,
                jax.random.bits(jax.random.key(11, impl=impl), (2, 5)))

    x = np.random.RandomState(8).randn(8, 12).astype(np.float32)
    low = check_same(f, x, jax.random.key(3, impl=impl))
    generated = [i.outputs[1].shape for i in low.spmd.instrs if i.opcode == "rng-bit-generator"]
    assert (8, 12) in generated, generated   # the whole draw, on each device


def test_non_partitionable_threefry_is_refused():
    with jax.threefry_partitionable(False):
        with pytest.raises(gspmd.ShardingError, match="jax_threefry_partitionable"):
            gspmd.jit(lambda k: jax.random.bits(k, (4,)))(jax.random.key(0))


@pytest.mark.parametrize("sample", [
    lambda key, x: jax.random.gamma(key, jnp.abs(x) + 0.5),                 # a shape per element
    lambda key, x: jax.random.beta(key, 2.0, 3.0, x.shape) * x,             # mixup's mixing weights
    lambda key, x: jax.random.dirichlet(key, jnp.abs(x) + 0.1)])
def test_gamma_family_samples_as_jax_does(sample):
    """jax.random.gamma, beta and dirichlet (the random_gamma primitive: rejection
    sampling, vectorized over a key per element) on values split unevenly (6 over 2, 10
    over 4), as jax.jit samples them: the same random bits and accept/reject decisions,
    floats to the last bits (XLA fuses the log-space ratios differently in the two programs)."""
    x = np.random.RandomState(5).standard_normal((6, 10)).astype(np.float32)
    check_same(lambda k, x: sample(k, split(x, "x", "y")), jax.random.key(7), x, reassociates=True)


def test_keys_pass_an_optimization_barrier_with_other_values():
    """jax.lax.optimization_barrier over keys and arrays together (recipes.rerun_forward's
    backward pass holds a layer's dropout key with its input)."""
    def f(key, x):
        key, x = jax.lax.optimization_barrier((key, split(x, "x", -1)))
        return x * jax.random.uniform(key, x.shape)
    check_same(f, jax.random.key(3), jnp.ones((6, 4)))
