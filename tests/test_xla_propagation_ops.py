"""Sharding completion on XLA's per-op propagation tests (openxla/xla,
xla/service/sharding_propagation_test.cc, the cases test_xla_propagation.py does not
cover; gathers and scatters are test_xla_propagation_indexing.py's): element-wise ops,
broadcasts, reductions, transposes, convolutions, dots and einsums, pads, slices and
concatenates, loops, conditionals, manual regions and unspecified dims, each a JAX
program with the annotations of the XLA test it is named after (shapes scaled down where
large), asserting XLA's completed layout and the bytes the partitioned program then
moves (none where the layouts agree), or a documented alternative that moves less."""
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import gspmd
from util import check_priced as _run, rand
from xla_cases import layout as xla, split

RNG = np.random.RandomState(1)
TILED = "devices=[1,2,2,1]0,1,2,3"


def _made_by(low, opcode: str, shape: tuple[int, ...]):
    """The completed layout of the value of `shape` that `opcode` makes."""
    return next(v for v in low.program.values()
                if v.producer is not None and v.producer.opcode == opcode and v.shape == shape).sharding


# -- element-wise and broadcast ---------------------------------------------------------------
def test_elementwise_operation_forward_pass():
    low, report = _run(lambda a, b: split(a, TILED) + b, rand(RNG, 5, 7, 11, 13), rand(RNG, 5, 7, 11, 13))
    assert low.sharding_of(0) == xla(TILED) and report.collective_bytes == 0


def test_elementwise_operation_backward_pass():
    low, report = _run(lambda a, b: split(a + b, TILED), rand(RNG, 5, 7, 11, 13), rand(RNG, 5, 7, 11, 13))
    assert all(p.sharding == xla(TILED) for p in low.program.params) and report.collective_bytes == 0


def test_broadcast_forward_pass():
    """[3, 16, 16] split [1,2,2] broadcast to a new minor dim: [1,2,2,1]."""
    low, report = _run(lambda x: jnp.broadcast_to(split(x, "devices=[1,2,2]0,1,2,3")[..., None], (3, 16, 16, 3)),
                       rand(RNG, 3, 16, 16))
    assert low.sharding_of(0) == xla(TILED) and report.collective_bytes == 0


def test_broadcast_backward_pass():
    """A [13] broadcast to [5,7,11,13] whose result is split [1,2,2,1]: the broadcast is split so."""
    low, report = _run(lambda x: split(jnp.broadcast_to(jnp.tanh(x), (5, 7, 11, 13)), TILED), rand(RNG, 13))
    assert _made_by(low, "broadcast", (5, 7, 11, 13)) == xla(TILED) and report.collective_bytes == 0


def test_broadcast_forward_partial():
    """[3, 64] split [1,2] over 2 of 4 devices, broadcast to [3, 64, 3]: [1,2,1,2] replicated."""
    spec = "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate"
    low, report = _run(lambda x: jnp.broadcast_to(split(x, spec)[..., None], (3, 64, 3)), rand(RNG, 3, 64))
    assert low.sharding_of(0) == xla("devices=[1,2,1,2]0,1,2,3 last_tile_dim_replicate")
    assert report.collective_bytes == 0


def test_broadcast_merge():
    """The operand's 2-way split of dim 1 and the result's 2-way split of the new dim 2,
    over orthogonal device pairs, merge into [1,2,2]; the result then gathers its dim 1
    to the annotation's layout, as XLA's does."""
    def f(x):
        y = jnp.broadcast_to(split(x, "devices=[1,2,2]0,1,2,3 last_tile_dim_replicate")[..., None], (3, 64, 4))
        return split(y, "devices=[1,1,2,2]0,2,1,3 last_tile_dim_replicate")
    low, report = _run(f, rand(RNG, 3, 64))
    assert _made_by(low, "broadcast", (3, 64, 4)) == xla("devices=[1,2,2]0,1,2,3")
    assert dict(report.counts()) == {"all-gather": 1} and report.collective_bytes == 3 * 64 * 2 * 4


def test_broadcast_user():
    """[24, 8] broadcast to [4, 24, 6, 8] split [1,2,1,4]: the operand is split [2,4]."""
    def f(x):
        return split(jnp.broadcast_to(jnp.tanh(x)[None, :, None, :], (4, 24, 6, 8)), "devices=[1,2,1,4]0,1,2,3,4,5,6,7")
    low, report = _run(f, rand(RNG, 24, 8))
    assert low.program.params[0].sharding == xla("devices=[2,4]0,1,2,3,4,5,6,7") and report.collective_bytes == 0


def test_broadcast_user_partial():
    """The broadcast split [4,2,1,1], its new dim 4 ways: the operand keeps the 2-way split
    of its dim 0, replicated over the devices that held the new dim's quarters."""
    def f(x):
        return split(jnp.broadcast_to(jnp.tanh(x)[None, :, None, :], (4, 24, 6, 8)), "devices=[4,2,1,1]0,1,2,3,4,5,6,7")
    low, report = _run(f, rand(RNG, 24, 8))
    assert low.program.params[0].sharding == xla("devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate")
    assert report.collective_bytes == 0


# -- reductions ---------------------------------------------------------------------------------
def test_sharded_reduce_forward_pass():
    """[5,7,11,13] split [1,2,2,1] summed over dims 0 and 3: [7, 11] split [2,2]."""
    low, report = _run(lambda x: jnp.sum(split(x, TILED), axis=(0, 3)), rand(RNG, 5, 7, 11, 13))
    assert low.sharding_of(0) == xla("devices=[2,2]0,1,2,3") and report.collective_bytes == 0


def test_reduce_partially_on_tiled_dims():
    """[8, 8] split [2,2] summed over dim 0: the partial sums all-reduced over the dim-0
    pairs, the result split on the other dim, replicated over the pairs."""
    low, report = _run(lambda x: jnp.sum(split(x, "devices=[2,2]0,1,2,3"), axis=0), rand(RNG, 8, 8))
    assert low.sharding_of(0) == xla("devices=[2,2]0,2,1,3 last_tile_dim_replicate")
    assert dict(report.counts()) == {"all-reduce": 1} and report.collective_bytes == 16


def test_reduce_partially_on_tiled_dims_of_a_partial_split():
    """ReducePartiallyOnTiledDims2: the same over [2,2,2] with the last dim replicated."""
    low, report = _run(lambda x: jnp.sum(split(x, "devices=[2,2,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate"), axis=0),
                       rand(RNG, 8, 8))
    assert low.sharding_of(0) == xla("devices=[2,4]0,1,4,5,2,3,6,7 last_tile_dim_replicate")
    assert dict(report.counts()) == {"all-reduce": 1} and report.collective_bytes == 16


def test_reduce_partially_backward():
    """A sum over dim 0 split [2] on its result (over 4 devices): the input gets [1,2,2] replicated."""
    low, report = _run(lambda x: split(jnp.sum(jnp.tanh(x), axis=0), "devices=[2,2]0,1,2,3 last_tile_dim_replicate"),
                       rand(RNG, 8, 8))
    assert low.program.params[0].sharding == xla("devices=[1,2,2]0,1,2,3 last_tile_dim_replicate")
    assert report.collective_bytes == 0


def test_sharded_tuple_reduce_forward_and_backward_pass():
    """A max-with-index reduction (two operands) of [28, 10] over dim 1, the indices split
    [2,1]: both results split [2], and the values operand split as the indices."""
    def argmax(x, i):
        def pick(a, b):
            better = a[0] > b[0]
            return jnp.where(better, a[0], b[0]), jnp.where(better, a[1], b[1])
        return lax.reduce((jnp.tanh(x), split(i, "devices=[2,1]0,1")), (-jnp.inf, 0), pick, (1,))
    idx = np.tile(np.arange(10, dtype=np.int32), (28, 1))
    low, report = _run(argmax, rand(RNG, 28, 10), idx)
    assert low.sharding_of(0) == xla("devices=[2]0,1") and low.sharding_of(1) == xla("devices=[2]0,1")
    assert low.program.params[0].sharding == xla("devices=[2,1]0,1") and report.collective_bytes == 0


# -- transpose, convolution -----------------------------------------------------------------------
def test_transpose_forward_pass():
    low, report = _run(lambda x: jnp.transpose(split(x, "devices=[2,1,2]0,1,2,3"), (1, 2, 0)), rand(RNG, 7, 11, 13))
    assert low.sharding_of(0) == xla("devices=[1,2,2]0,2,1,3") and report.collective_bytes == 0


def _conv(lhs, rhs, specs, **kw):
    return lax.conv_general_dilated(lhs, rhs, dimension_numbers=specs, **kw)


def test_forward_convolution_forward_pass():
    """b01f_01io->b01f, 3x3 window padded 1: the lhs's [2,2,2,1] split carries to the result."""
    def f(x, k):
        return _conv(split(x, "devices=[2,2,2,1]0,1,2,3,4,5,6,7"), k, ("NHWC", "HWIO", "NHWC"),
                     window_strides=(1, 1), padding=[(1, 1), (1, 1)])
    low, report = _run(f, rand(RNG, 4, 8, 10, 13), rand(RNG, 3, 3, 13, 17))
    assert low.sharding_of(0) == xla("devices=[2,2,2,1]0,1,2,3,4,5,6,7")
    assert set(dict(report.counts())) <= {"collective-permute"}    # halos of the split spatial dims


def test_forward_convolution_large_dilation_forward_pass():
    """[8, 64, 2] split 4 ways on the spatial dim, a kernel of 3 dilated 16: the result too."""
    def f(x, k):
        return _conv(split(x, "devices=[1,4,1]0,1,2,3"), k, ("NWC", "WIO", "NWC"), window_strides=(1,),
                     padding=[(0, 0)], rhs_dilation=(16,))
    low, report = _run(f, rand(RNG, 8, 64, 2), rand(RNG, 3, 2, 2))
    assert low.sharding_of(0) == xla("devices=[1,4,1]0,1,2,3") and not report.fallbacks


def test_valid_convolution():
    """b0f_i0o->b0f over [13, 17, 19] split on the spatial dim: the result too."""
    def f(x, k):
        return _conv(split(x, "devices=[1,2,1]0,1"), k, ("NWC", "IWO", "NWC"), window_strides=(1,), padding="VALID")
    low, report = _run(f, rand(RNG, 13, 17, 19), rand(RNG, 19, 5, 19))
    assert low.sharding_of(0) == xla("devices=[1,2,1]0,1") and set(dict(report.counts())) <= {"collective-permute"}


def test_convolution_sharded_feature():
    """bf0_oi0->bf0 with the lhs split on its (contracted) feature dim: the result is
    replicated, the partial sums all-reduced."""
    def f(x, k):
        return _conv(split(x, "devices=[1,2,1]0,1"), k, ("NCW", "OIW", "NCW"), window_strides=(1,), padding="VALID")
    low, report = _run(f, rand(RNG, 3, 2, 3), rand(RNG, 2, 2, 1))
    assert low.sharding_of(0).is_replicated and dict(report.counts()) == {"all-reduce": 1}


def test_convolution_different_dimension_numbers():
    """f0b_i0o->0bf: the lhs's split spatial dim (16, 2 ways) becomes the result's dim 0."""
    def f(x, k):
        return _conv(split(x, "devices=[1,2,1]0,1"), k, ("CWN", "IWO", "WNC"), window_strides=(5,), padding="VALID")
    low, _ = _run(f, rand(RNG, 8, 16, 32), rand(RNG, 8, 2, 32))
    assert low.sharding_of(0) == xla("devices=[2,1,1]0,1")


# -- pad, slice, concatenate ------------------------------------------------------------------------
def test_pad_backward_pass():
    low, report = _run(lambda x, v: split(lax.pad(jnp.tanh(x), v, [(2, 4, 1), (1, 1, 2)]), "devices=[2,2]0,1,2,3"),
                       rand(RNG, 11, 17), np.float32(0.5))
    assert low.program.params[0].sharding == xla("devices=[2,2]0,1,2,3")


def test_strided_slice():
    low, _ = _run(lambda x: split(x, "devices=[2,1]0,1")[1:15:2, 5:10], rand(RNG, 17, 13))
    assert low.sharding_of(0) == xla("devices=[2,1]0,1")


def test_concatenate():
    """Both operands split [2,1], concatenated along the unsplit dim 1: [2,1]."""
    def f(a, b):
        return jnp.concatenate([split(a, "devices=[2,1]0,1"), split(b, "devices=[2,1]0,1")], axis=1)
    low, report = _run(f, rand(RNG, 5, 7), rand(RNG, 5, 9))
    assert low.sharding_of(0) == xla("devices=[2,1]0,1") and report.collective_bytes == 0


def test_tuple_backward_pass():
    """Results laid out one replicated, one split [2]: each operand as its result."""
    low, report = _run(lambda a, b: (split(jnp.tanh(a), "devices=[1,2]0,1 last_tile_dim_replicate"),
                                     split(jnp.tanh(b), "devices=[2]0,1")), rand(RNG, 1), rand(RNG, 4))
    assert low.program.params[1].sharding == xla("devices=[2]0,1") and report.collective_bytes == 0


# -- loops ----------------------------------------------------------------------------------------
def _doubling_loop(x, inside: str, x_spec=None):
    """While: a carry doubled 4 times, the doubled value annotated `inside` the body,
    then multiplied with the loop's input."""
    def body(_, acc):
        return split(acc + acc, inside)
    x = jnp.tanh(x) if x_spec is None else split(x, x_spec)
    return lax.fori_loop(0, 4, body, x) * x


def test_while_carry_takes_the_bodys_layout():
    """While (from acc.1): a [2,1] split inside the body lays out the carry, the loop's
    input and its result alike; nothing moves."""
    low, report = _run(lambda x: _doubling_loop(x, "devices=[2,1]0,1"), rand(RNG, 10, 10))
    assert low.sharding_of(0) == xla("devices=[2,1]0,1")
    assert low.program.params[0].sharding == xla("devices=[2,1]0,1") and report.collective_bytes == 0


def test_while_merges_the_inputs_and_the_bodys_partial_splits():
    """While (merge): the body's rows split 2 ways and the input's columns over the other
    device pairs: the carry is split [2,2]."""
    low, report = _run(lambda x: _doubling_loop(x, "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate",
                                                "devices=[1,2,2]0,2,1,3 last_tile_dim_replicate"), rand(RNG, 10, 10))
    loop = next(v for v in low.program.values() if v.producer is not None and v.producer.opcode == "while"
                and v.shape == (10, 10))
    assert loop.sharding == xla("devices=[2,2]0,1,2,3")


# -- first-iteration pass-through (DoNotPassThrough...AtFirstIteration), on 8 devices ----------------
def test_concatenate_takes_its_users_layout_not_its_operands():
    """[8, 32, 24] split 2 ways (replicated 4), concatenated to [16, 32, 24] whose user is
    split [4,1,2]: the concatenate is laid out as its user (the stronger split), not passed
    its operand's on the first iteration."""
    def f(x):
        x = split(x, "devices=[2,1,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate")
        c = jnp.concatenate([x, x], axis=0)
        return split(c + c, "devices=[4,1,2]0,1,2,3,4,5,6,7")
    low, _ = _run(f, rand(RNG, 8, 32, 24))
    assert _made_by(low, "concatenate", (16, 32, 24)) == xla("devices=[4,1,2]0,1,2,3,4,5,6,7")


def test_dynamic_slice_takes_its_users_layout_not_its_operands():
    def f(x, i):
        x = split(x, "devices=[2,1,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate")
        d = lax.dynamic_slice_in_dim(x, i, 16, axis=0)
        return split(d + d, "devices=[4,1,2]0,1,2,3,4,5,6,7")
    low, _ = _run(f, rand(RNG, 32, 32, 24), np.int32(3))
    assert _made_by(low, "dynamic-slice", (16, 32, 24)) == xla("devices=[4,1,2]0,1,2,3,4,5,6,7")


# -- dots -------------------------------------------------------------------------------------------
def test_dot_forward_and_backward():
    """Dot: the lhs's M split 4 ways and the rhs's N 4 ways (the same devices) each reach
    the products that keep them; a result split [1,2,2] lays out operands it alone reads."""
    def f(a, b, v, a2, b2):
        a, b = split(a, "devices=[1,4,1]0,1,2,3"), split(b, "devices=[1,1,4]0,1,2,3")
        prop_rhs = jnp.einsum("bmk,bkn->bmn", jnp.tanh(a), b)
        prop_lhs = jnp.einsum("bkn,bmk->bnm", b, jnp.tanh(a))
        mat_vec = jnp.einsum("bmk,bk->bm", a, v)
        back = split(jnp.einsum("bmk,bkn->bmn", jnp.tanh(a2), jnp.tanh(b2)), "devices=[1,2,2]0,1,2,3")
        return prop_rhs, prop_lhs, mat_vec, back
    args = [rand(RNG, 4, 16, 8), rand(RNG, 4, 8, 32), rand(RNG, 4, 8), rand(RNG, 4, 16, 8), rand(RNG, 4, 8, 32)]
    low, _ = _run(f, *args)
    assert low.sharding_of(0) == xla("devices=[1,1,4]0,1,2,3") and low.sharding_of(1) == xla("devices=[1,4,1]0,1,2,3")
    assert low.sharding_of(2) == xla("devices=[1,4]0,1,2,3")
    assert low.sharding_of(3) == xla("devices=[1,2,2]0,1,2,3")
    assert low.program.params[3].sharding == xla("devices=[1,2,1,2]0,1,2,3 last_tile_dim_replicate")
    assert low.program.params[4].sharding == xla("devices=[1,1,2,2]0,2,1,3 last_tile_dim_replicate")


def test_dot_tiled_batch_dim():
    """A batched product reshaped [8, 16, 8] -> [8, 128] split [2,2]: its lhs's producer
    (an add) is split [2,2,1] (batch and M), the reshape's major factor reaching M."""
    def f(x, w):
        y = jnp.einsum("bmk,bkn->bmn", x + x, w)
        return split(y.reshape(8, 128), "devices=[2,2]0,1,2,3")
    low, report = _run(f, rand(RNG, 8, 16, 32), rand(RNG, 8, 32, 8))
    assert _made_by(low, "add", (8, 16, 32)) == xla("devices=[2,2,1]0,1,2,3") and report.collective_bytes == 0


def test_convolution_filter_split_on_in_and_out_features():
    """ConvolutionFilterIFOFPartitionedInputPartialReplicate: the input's features split
    2 ways (replicated 2), the filter's in and out features 2x2: the result keeps the out
    features' split, over the devices that held each half of the filter's."""
    def f(x, k):
        x = split(x, "devices=[1,1,1,2,2]0,1,2,3 last_tile_dim_replicate")
        k = split(k, "devices=[1,1,2,2]0,1,2,3")
        return _conv(x, k, ("NHWC", "HWIO", "NHWC"), window_strides=(2, 2), padding=[(3, 3), (3, 3)])
    low, report = _run(f, rand(RNG, 2, 8, 8, 12), rand(RNG, 7, 7, 12, 16))
    assert low.sharding_of(0) == xla("devices=[1,1,1,2,2]0,2,1,3 last_tile_dim_replicate")
    assert dict(report.counts()) == {"all-reduce": 1}     # the in features' partial sums


def test_concatenate_operands_take_a_user_split_on_the_concatenated_dim():
    """ConcatFromUserShardedDim: [16, 128] split 3 ways (6, 6, 4 rows) from its user.
    XLA's test expects each [8, 128] operand over the devices that hold its rows
    ([2,1]0,1 and [2,1]1,2), but runs propagation with is_spmd=false: under SPMD XLA gives
    the operands the user's own layout ("SPMD doesn't support tiling with part of the
    devices"), as gspmd does. On that program XLA's partitioner all-gathers both operands
    (2 x 4,608 B per device, jax.jit under GSPMD propagation); gspmd sends each device
    only the rows it lacks: two collective-permutes, 3,072 B received."""
    def f(a, b):
        return split(jnp.concatenate([jnp.tanh(a), jnp.tanh(b)], axis=0), "devices=[3,1]0,1,2")
    low, report = _run(f, rand(RNG, 8, 128), rand(RNG, 8, 128))
    assert all(p.sharding == xla("devices=[3,1]0,1,2") for p in low.program.params)
    assert dict(report.counts()) == {"collective-permute": 2} and report.collective_bytes == 3072


def test_conditional_branches_take_the_layouts_that_reach_them():
    """Conditional (on 6 devices): the true branch transposes an operand split 2 ways on
    its columns; the false branch returns one split 3 ways on its columns: the
    conditional's result takes the false branch's layout, to which the true branch turns
    its transpose (each device receives the other half of its column: 12 B), as XLA's."""
    def f(p, a, b):
        a = split(a, "devices=[1,2,3]0,1,2,3,4,5 last_tile_dim_replicate")
        b = split(b, "devices=[1,3,2]0,1,2,3,4,5 last_tile_dim_replicate")
        return lax.cond(p, lambda a, b: a.T * 2, lambda a, b: b, a, b)
    low, report = _run(f, np.bool_(True), rand(RNG, 3, 6), rand(RNG, 6, 3))
    assert low.sharding_of(0) == xla("devices=[1,3,2]0,1,2,3,4,5 last_tile_dim_replicate")
    assert dict(report.counts()) == {"collective-permute": 1} and report.collective_bytes == 12


# -- einsums written as convolutions in XLA's tests, here as einsums ----------------------------------
def test_einsum_output_batch_partitioned():
    """EinsumOutputBatchPartitioned: the result's batch split reaches both operands."""
    low, report = _run(lambda a, b: split(jnp.einsum("bmk,bnk->bmn", jnp.tanh(a), jnp.tanh(b)), "devices=[2,1,1]0,1"),
                       rand(RNG, 4, 6, 8), rand(RNG, 4, 10, 8))
    assert all(p.sharding == xla("devices=[2,1,1]0,1") for p in low.program.params) and report.collective_bytes == 0


def test_einsum_lhs_and_output_non_contracting_partitioned():
    """EinsumLHSNonContractingPartitioned and its Output twin: the lhs's M and J splits
    [1,2,1,2] reach the result [1,2,1,2], and back."""
    def forward(a, b):
        return jnp.einsum("bmkj,bnk->bmnj", split(a, "devices=[1,2,1,2]0,1,2,3"), jnp.tanh(b))

    def backward(a, b):
        return split(jnp.einsum("bmkj,bnk->bmnj", jnp.tanh(a), jnp.tanh(b)), "devices=[1,2,1,2]0,1,2,3")
    args = rand(RNG, 2, 6, 8, 4), rand(RNG, 2, 10, 8)
    low, report = _run(forward, *args)
    assert low.sharding_of(0) == xla("devices=[1,2,1,2]0,1,2,3") and report.collective_bytes == 0
    low, report = _run(backward, *args)
    assert low.program.params[0].sharding == xla("devices=[1,2,1,2]0,1,2,3") and report.collective_bytes == 0


def test_einsum_rhs_and_output_non_contracting_partitioned():
    """EinsumRHSNonContractingPartitioned and its Output twin: the rhs's N and J splits
    reach the result [1,1,2,2], and back."""
    def forward(a, b):
        return jnp.einsum("bmk,bnkj->bmnj", jnp.tanh(a), split(b, "devices=[1,2,1,2]0,1,2,3"))

    def backward(a, b):
        return split(jnp.einsum("bmk,bnkj->bmnj", jnp.tanh(a), jnp.tanh(b)), "devices=[1,1,2,2]0,1,2,3")
    args = rand(RNG, 2, 6, 8), rand(RNG, 2, 10, 8, 4)
    low, report = _run(forward, *args)
    assert low.sharding_of(0) == xla("devices=[1,1,2,2]0,1,2,3") and report.collective_bytes == 0
    low, report = _run(backward, *args)
    assert low.program.params[1].sharding == xla("devices=[1,2,1,2]0,1,2,3") and report.collective_bytes == 0


# -- manual regions and unspecified dims --------------------------------------------------------------
def test_simple_manual():
    """SimpleManual: rows split [2,1] into a manual region that sums each row: the region's
    result leaves split [2], and nothing moves."""
    mesh = gspmd.Mesh(np.arange(2), ("x",))
    row_sums = gspmd.manual(lambda x: jnp.sum(x, axis=1), mesh, in_specs=[["x", -1]], out_specs=["x"])
    low, report = _run(lambda x: row_sums(gspmd.mesh_split(jnp.tanh(x), mesh, ["x", -1])), rand(RNG, 6, 3))
    assert low.sharding_of(0) == xla("devices=[2]0,1") and report.collective_bytes == 0


def test_refine_unspecified_dims():
    """RefineUnspecifiedDims: columns split over one mesh axis, then an annotation that
    splits the rows over the other and leaves the columns unspecified: the value after it
    is split on both, [2,2]0,2,1,3."""
    mesh = gspmd.Mesh(np.arange(4).reshape(2, 2), ("r", "c"))

    def f(x):
        y = gspmd.mesh_split(jnp.tanh(x), mesh, [-1, "r"])
        return jnp.tanh(gspmd.mesh_split(y, mesh, ["c", gspmd.UNSPECIFIED]))
    low, report = _run(f, rand(RNG, 6, 4))
    assert low.sharding_of(0) == xla("devices=[2,2]0,2,1,3") and report.collective_bytes == 0


def test_reshape_trivial_dim_partial_replicate():
    """ReshapeTrivialDimPartialReplicate: [8, 128] -> [8, 1, 128] split [1,2,4] (the size-1
    dim 2 ways). XLA gives the operand quarters of the 128 held by device pairs 0-1, 2-3,
    ...; gspmd the quarters as the annotation holds them (devices j and 4 + j), a
    documented alternative: nothing moves, where XLA's layout needs a collective-permute
    of 1,024 B."""
    target = "devices=[1,2,4]0,1,2,3,4,5,6,7"
    low, report = _run(lambda x: split(jnp.tanh(x).reshape(8, 1, 128), target), rand(RNG, 8, 128))
    assert low.program.params[0].sharding == xla("devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate")
    assert report.collective_bytes == 0
    xla_layout = "devices=[1,4,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate"
    _, theirs = _run(lambda x: split(split(jnp.tanh(x), xla_layout).reshape(8, 1, 128), target), rand(RNG, 8, 128))
    assert dict(theirs.counts()) == {"collective-permute": 1} and theirs.collective_bytes == 1024


def test_merge_compatible_tiles():
    """MergeCompatibleTiles: an add of an operand split 8 ways and one split 4 ways
    (replicated twice, quarters nesting the eighths): the second's copy takes the finer
    split, so nothing moves."""
    def f(a, b):
        a = split(a, f"devices=[8,1]{','.join(map(str, range(8)))}")
        c = split(b, f"devices=[4,1,2]{','.join(map(str, range(8)))} last_tile_dim_replicate") * 2
        return split(a + c, f"devices=[8,1]{','.join(map(str, range(8)))}")
    low, report = _run(f, rand(RNG, 16, 4), rand(RNG, 16, 4))
    assert _made_by(low, "multiply", (16, 4)) == xla("devices=[8,1]0,1,2,3,4,5,6,7") and report.collective_bytes == 0


def _argsort_rows(x, result_spec=None):
    v = split(-x, "devices=[1,8]0,1,2,3,4,5,6,7")
    out = lax.sort((v, lax.broadcasted_iota(jnp.int32, v.shape, 1)), dimension=1, num_keys=1)
    return out if result_spec is None else tuple(split(o, result_spec) for o in out)


def test_sort_operand_split_on_the_sort_dim():
    """SortOperandShardedOnSortDim_RankTwo: values split 8 ways along the dim a sort (with
    their iota: an argsort) runs along. XLA lays the sort and the iota out as the values;
    gspmd moves the split to the other dim, where each row sorts whole (one all-to-all
    of the values, 512 B), a documented alternative: XLA's layout moves the values there
    and both results back (1,536 B)."""
    low, report = _run(_argsort_rows, rand(RNG, 16, 64))
    assert low.sharding_of(0) == low.sharding_of(1) == xla("devices=[8,1]0,1,2,3,4,5,6,7")
    assert dict(report.counts()) == {"all-to-all": 1} and report.collective_bytes == 512
    _, theirs = _run(lambda x: _argsort_rows(x, "devices=[1,8]0,1,2,3,4,5,6,7"), rand(RNG, 16, 64))
    assert theirs.collective_bytes == 1536


# -- partial splits that combine ----------------------------------------------------------------------
def test_partial_sharding_on_elementwise():
    """PartialShardingOnElementwise (and 2): an add of operands split on different dims
    over orthogonal device groups is split on both."""
    for a_spec, b_spec, merged in [
            ("devices=[1,2,2]0,1,2,3 last_tile_dim_replicate", "devices=[2,1,2]0,2,1,3 last_tile_dim_replicate",
             "devices=[2,2]0,2,1,3"),
            ("devices=[1,2,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate",
             "devices=[2,1,4]0,1,4,5,2,3,6,7 last_tile_dim_replicate",
             "devices=[2,2,2]0,1,4,5,2,3,6,7 last_tile_dim_replicate")]:
        low, report = _run(lambda a, b, a_spec=a_spec, b_spec=b_spec: split(a, a_spec) + split(b, b_spec),
                           rand(RNG, 2, 9), rand(RNG, 2, 9))
        assert low.sharding_of(0) == xla(merged) and report.collective_bytes == 0, merged


def test_partial_sharding_transpose_forward_and_backward():
    spec = "devices=[2,1,2,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate"
    low, report = _run(lambda x: jnp.transpose(split(x, spec), (1, 2, 0)), rand(RNG, 7, 11, 13))
    assert low.sharding_of(0) == xla("devices=[1,2,2,2]0,1,4,5,2,3,6,7 last_tile_dim_replicate")
    assert report.collective_bytes == 0
    back = "devices=[1,2,2,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate"
    low, report = _run(lambda x: split(jnp.transpose(jnp.tanh(x), (1, 2, 0)), back), rand(RNG, 7, 11, 13))
    assert low.program.params[0].sharding == xla("devices=[2,1,2,2]0,1,4,5,2,3,6,7 last_tile_dim_replicate")
    assert report.collective_bytes == 0
