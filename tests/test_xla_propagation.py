"""Sharding completion on XLA's own propagation tests (openxla/xla,
xla/service/sharding_propagation_test.cc): each case is a JAX program with the
annotations of the XLA test it is named after (shapes scaled down), asserting XLA's
completed layout, or a documented alternative that moves no more bytes, and the bytes
the partitioned program then moves (priced and counted as bytes each device receives)."""
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from util import BACKENDS, check_priced, rand
from xla_cases import layout as xla, split

RNG = np.random.RandomState(0)


def devices(n: int) -> str:
    return ",".join(map(str, range(n)))


def _run(fn, *args, backends=BACKENDS):
    """check_priced(); 12-device meshes on the sim backend only (jax has 8 CPU devices here)."""
    return check_priced(fn, *args, backends=backends)


def _produced(low, opcode: str):
    return next(v for v in low.program.values() if v.producer is not None and v.producer.opcode == opcode)


# -- merging a partial split with a finer split of the same dim (IsSubTilingOrEqualSharding) --
def _coarse_then_fine(coarse: str, fine: str, shape: tuple[int, ...]):
    """tanh between an annotation `coarse` of its operand and `fine` of its user."""
    def f(x):
        return split(jnp.tanh(split(x, coarse)) * 2, fine)
    low, report = _run(f, rand(RNG, *shape))
    return _produced(low, "tanh").sharding, report


def test_partial_split_refines_to_a_finer_nested_split():
    """A dim split 4 ways and replicated twice meets an 8-way split of it whose eighths
    nest in the quarters: the value between them is split 8 ways (was: 4 ways, held and
    computed twice over)."""
    layout, report = _coarse_then_fine(f"devices=[4,1,2]{devices(8)} last_tile_dim_replicate",
                                       f"devices=[8,1]{devices(8)}", (16, 6))
    assert layout == xla(f"devices=[8,1]{devices(8)}")
    assert report.collective_bytes == 0 and report.flops == 24     # was 48: each quarter computed twice


def test_partial_split_meets_a_finer_split_that_does_not_nest():
    """Eighths in another device order (the quarter's devices do not hold its eighths):
    no merge, the 4-way layout stays and the partitioner moves the data."""
    coarse = f"devices=[4,1,2]{devices(8)} last_tile_dim_replicate"
    layout, _ = _coarse_then_fine(coarse, "devices=[8,1]0,2,4,6,1,3,5,7", (16, 6))
    assert layout == xla(coarse)


def test_uneven_partial_split_refines_to_a_finer_split_that_nests():
    """15 rows: halves of 8, quarters of 4, two quarters to a half (uneven, but nested)."""
    layout, _ = _coarse_then_fine(f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate",
                                  f"devices=[4,1,2]{devices(8)} last_tile_dim_replicate", (15, 3))
    assert layout == xla(f"devices=[4,1,2]{devices(8)} last_tile_dim_replicate")


def test_uneven_partial_split_keeps_a_finer_split_that_does_not_nest():
    """13 rows: halves of 7, eighths of 2: the fourth eighth (rows 6-7) crosses the
    halves, so the 8-way split would not refine the 2-way one (XLA's sub-tiling is
    shape-aware too): the 2-way layout stays."""
    coarse = f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate"
    layout, _ = _coarse_then_fine(coarse, f"devices=[8,1]{devices(8)}", (13, 3))
    assert layout == xla(coarse)


# -- reshapes that share only a major factor (ReshapeSharding) --------------------------------
def test_reshape_forward_carries_the_major_factor():
    """[12, 8] split 2x4 -> [8, 12]: the dims share a major factor of 4, so the 2-way
    split of the 12 carries to the 8 (was: replicated, 480 B; now 192 B)."""
    def f(x):
        return jnp.tanh(split(x, f"devices=[2,4]{devices(8)}").reshape(8, 12))
    low, report = _run(f, rand(RNG, 12, 8))
    assert low.sharding_of(0) == xla(f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 192


def test_reshape_backward_carries_the_major_factor():
    """The same reshape, laid out from its result: the operand gets the 2-way split."""
    def f(x):
        y = jnp.tanh(x).reshape(8, 12)
        return split(y, f"devices=[2,4]{devices(8)}")
    low, report = _run(f, rand(RNG, 12, 8))
    assert low.program.params[0].sharding == xla(f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 0 and report.flops == 48     # was 96: tanh computed replicated


def test_reshape_of_a_split_only_of_the_major_dim_carries_it_whole():
    """A 6-way split of the 12 ([12, 8] -> [8, 12]; the dims share a factor of 4, so
    only 2 of the 6 carry exactly): the whole split goes to the result's major dim and
    the partitioner realigns the shards by halo exchange (paper Figure 5), a documented
    alternative to XLA's 2-way split that moves less (128 B, no gather)."""
    def f(x):
        return jnp.tanh(split(x, f"devices=[6,1,2]{devices(12)} last_tile_dim_replicate").reshape(8, 12))
    low, report = _run(f, rand(RNG, 12, 8), backends=("sim",))
    assert low.sharding_of(0) == xla(f"devices=[6,1,2]{devices(12)} last_tile_dim_replicate")
    assert report.collective_bytes == 128 and dict(report.counts()) == {"collective-permute": 2}


def test_reshape_chain_keeps_the_major_factor():
    """Six reshapes of a 12-device tensor, each sharing a major factor with the next:
    was 672 B (the split lost at the first), now 288 B."""
    def f(x):
        x = split(x, f"devices=[2,6]{devices(12)}")
        for shape in [(8, 18), (12, 12), (18, 8), (4, 36), (12, 12), (6, 24)]:
            x = jnp.tanh(x.reshape(shape))
        return x
    low, report = _run(f, rand(RNG, 12, 12), backends=("sim",))
    assert low.sharding_of(0) == xla(f"devices=[2,1,6]{devices(12)} last_tile_dim_replicate")
    assert report.collective_bytes == 288


def test_reshape_of_an_uneven_split_carries_it_whole():
    """[12, 10] split 8 ways on the 12 (uneven) -> [10, 12]: likewise carried whole and
    realigned by halo exchange (80 B) rather than cut to the shared factor's 2 ways."""
    def f(x):
        return jnp.tanh(split(x, f"devices=[8,1]{devices(8)}").reshape(10, 12))
    low, report = _run(f, rand(RNG, 12, 10))
    assert low.sharding_of(0) == xla(f"devices=[8,1]{devices(8)}")
    assert report.collective_bytes == 80 and not report.fallbacks


def test_reshape_of_an_uneven_minor_dim_keeps_the_major_factor():
    """[12, 7] split 2x4 -> [4, 21]: the 7 splits unevenly and shares no factor, the
    12's 2-way split carries to the 4 through their common factor of 4."""
    def f(x):
        return jnp.tanh(split(x, f"devices=[2,4]{devices(8)}").reshape(4, 21))
    low, _ = _run(f, rand(RNG, 12, 7))
    assert low.sharding_of(0).tiles == (2, 1)


# -- operands that conflict: settled by what resharding costs ------------------------------
def _einsum(equation: str, lhs: str, rhs: str, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]):
    """The einsum of two operands annotated `lhs` and `rhs`: its result's layout, the report."""
    def f(a, b):
        return jnp.einsum(equation, split(a, lhs), split(b, rhs))
    low, report = _run(f, rand(RNG, *lhs_shape), rand(RNG, *rhs_shape))
    return low.sharding_of(0), report


def test_dot_merge_operands2_keeps_the_larger_operands_split():
    """DotMergeOperands2: both operands [2,2,2] over the same devices, so the lhs's M
    and the rhs's N cannot both be split; XLA keeps the larger lhs's."""
    layout, report = _einsum("bmk,bnk->bmn", f"devices=[2,2,2]{devices(8)}",
                             f"devices=[2,2,2]{devices(8)}", (4, 16, 8), (4, 8, 8))
    assert layout == xla(f"devices=[2,2,1,2]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 768


def test_dot_merge_operands2_prefers_the_larger_rhs():
    """The same with the rhs the larger: its split is kept (the lhs's was before)."""
    layout, report = _einsum("bmk,bnk->bmn", f"devices=[2,2,2]{devices(8)}",
                             f"devices=[2,2,2]{devices(8)}", (4, 8, 8), (4, 16, 8))
    assert layout == xla(f"devices=[2,1,2,2]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 768      # was 1,024 B


def test_dot_merge_operands3_merges_compatible_splits():
    """DotMergeOperands3: M split 2 ways by the lhs, N 4 ways by the rhs in a device
    order that nests: XLA's [2,4]0,2,3,1,4,6,7,5."""
    layout, _ = _einsum("mk,nk->mn", f"devices=[2,4]{devices(8)}", "devices=[4,2]0,4,2,6,3,7,1,5", (16, 8), (8, 8))
    assert layout == xla("devices=[2,4]0,2,3,1,4,6,7,5")


def test_plain_dot_keeps_the_split_of_the_larger_operand():
    """lhs [16, 16] split on M, rhs [16, 64] split on N over the same 2 devices: the
    rhs's split is kept and the small lhs gathered (was: 3,072 B; now 1,024 B)."""
    layout, report = _einsum("mk,kn->mn", f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate",
                             f"devices=[1,2,4]{devices(8)} last_tile_dim_replicate", (16, 16), (16, 64))
    assert layout == xla(f"devices=[1,2,4]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 1024 and dict(report.counts()) == {"all-gather": 1}


def test_einsum_keeps_the_split_of_the_operand_nine_times_larger():
    """mk,khn->mhn: the lhs splits M, the 9x larger rhs N, over the same devices; the
    rhs's split is kept and only the lhs gathered (was 1,408 B, now 256 B)."""
    layout, report = _einsum("mk,khn->mhn", f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate",
                             f"devices=[1,1,2,4]{devices(8)} last_tile_dim_replicate", (8, 8), (8, 9, 8))
    assert layout == xla(f"devices=[1,1,2,4]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 256 and dict(report.counts()) == {"all-gather": 1}


def test_batch_split_wins_a_tie():
    """The lhs splits M, the rhs the batch dim; either way moves as much (the lhs,
    twice the rhs, by an all-to-all, or the rhs gathered): XLA's preference, the batch
    split, decides (was: the first operand's M)."""
    layout, report = _einsum("bmk,bkn->bmn", f"devices=[1,2,1,4]{devices(8)} last_tile_dim_replicate",
                             f"devices=[2,1,1,4]{devices(8)} last_tile_dim_replicate", (4, 16, 8), (4, 8, 8))
    assert layout == xla(f"devices=[2,1,1,4]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 1024 and dict(report.counts()) == {"all-to-all": 1}


def test_elementwise_conflict_keeps_the_first_operands_split():
    """add of two equal tensors split on different dims by the same devices: a tie in
    every respect, the first operand's layout is kept and the second resharded."""
    def f(a, b):
        a = split(a, f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate")
        b = split(b, f"devices=[1,2,4]{devices(8)} last_tile_dim_replicate")
        return a + b
    low, report = _run(f, rand(RNG, 8, 6), rand(RNG, 8, 6))
    assert low.sharding_of(0) == xla(f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate")
    assert dict(report.counts()) == {"all-to-all": 1}


def test_select_keeps_the_split_of_the_operand_dearer_to_move():
    """select(pred, x, y) with the bool pred split by rows and the float x by columns:
    the generic rule (not the dot's) keeps x's split and moves the 1-byte pred (was:
    the first operand's, x moved: 512 B; now 128 B)."""
    def f(m, x, y):
        return jnp.where(split(m, f"devices=[2,1,4]{devices(8)} last_tile_dim_replicate"),
                         split(x, f"devices=[1,2,4]{devices(8)} last_tile_dim_replicate"), y)
    low, report = _run(f, RNG.rand(16, 16) > 0.5, rand(RNG, 16, 16), rand(RNG, 16, 16))
    assert low.sharding_of(0) == xla(f"devices=[1,2,4]{devices(8)} last_tile_dim_replicate")
    assert report.collective_bytes == 128 and dict(report.counts()) == {"all-to-all": 1}


# -- more of XLA's cases, at their own shapes ------------------------------------------------
def test_reshape_forward_pass():
    """ReshapeForwardPass: [1430, 1] split 2 ways -> [10, 11, 13] split on the 10."""
    low, report = _run(lambda x: jnp.tanh(split(x, "devices=[2,1]0,1").reshape(10, 11, 13)), rand(RNG, 1430, 1))
    assert low.sharding_of(0) == xla("devices=[2,1,1]0,1") and report.collective_bytes == 0


def test_partial_replicate_reshape_forward_pass():
    low, report = _run(lambda x: jnp.tanh(split(x, "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate")
                                          .reshape(10, 11, 13)), rand(RNG, 1430, 1))
    assert low.sharding_of(0) == xla("devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate")
    assert report.collective_bytes == 0


def test_reshape_backward_pass():
    """ReshapeBackwardPass: [2002, 1] -> [14, 11, 13] split on the 14: the operand is split 2 ways."""
    low, report = _run(lambda x: split(jnp.tanh(x).reshape(14, 11, 13), "devices=[2,1,1]0,1"), rand(RNG, 2002, 1))
    assert low.program.params[0].sharding == xla("devices=[2,1]0,1") and report.collective_bytes == 0


def test_partial_replicate_reshape_backward_pass():
    low, report = _run(lambda x: split(jnp.tanh(x).reshape(14, 11, 13),
                                       "devices=[2,1,1,2]0,1,2,3 last_tile_dim_replicate"), rand(RNG, 2002, 1))
    assert low.program.params[0].sharding == xla("devices=[2,1,2]0,1,2,3 last_tile_dim_replicate")
    assert report.collective_bytes == 0


def test_transpose_backward_pass():
    """TransposeBackwardPass: [7, 11, 13] transposed to [11, 13, 7], split [1,2,2] there."""
    low, report = _run(lambda x: split(jnp.transpose(jnp.tanh(x), (1, 2, 0)), "devices=[1,2,2]0,1,2,3"),
                       rand(RNG, 7, 11, 13))
    assert low.program.params[0].sharding == xla("devices=[2,1,2]0,2,1,3") and report.collective_bytes == 0


def test_strided_slice():
    """PartialReplicatedStridedSlice: [17, 13] split [2,1,2] -> slice [1:15:2, 5:10]."""
    low, _ = _run(lambda x: jnp.tanh(split(x, "devices=[2,1,2]0,1,2,3 last_tile_dim_replicate")[1:15:2, 5:10]),
                  rand(RNG, 17, 13))
    assert low.sharding_of(0) == xla("devices=[2,1,2]0,1,2,3 last_tile_dim_replicate")


def test_sharded_preferred_over_replicated():
    """ShardedPreferredOverReplicated: an add of a replicated and a split operand is split."""
    def f(a, b):
        return split(a, "devices=[1,1,1,1,4]0,1,2,3 last_tile_dim_replicate") + split(b, "devices=[1,2,2,1]0,1,2,3")
    low, _ = _run(f, rand(RNG, 5, 7, 11, 13), rand(RNG, 5, 7, 11, 13))
    assert low.sharding_of(0) == xla("devices=[1,2,2,1]0,1,2,3")


def test_dot_merge_operands():
    """DotMergeOperands: the lhs splits batch and M, the rhs batch and N, partially
    tiled over devices that nest: the dot is split 2x2x2."""
    layout, report = _einsum("bmk,bnk->bmn", f"devices=[2,2,1,2]{devices(8)} last_tile_dim_replicate",
                             "devices=[2,2,1,2]0,2,1,3,4,6,5,7 last_tile_dim_replicate", (4, 8, 16), (4, 8, 16))
    assert layout == xla(f"devices=[2,2,2]{devices(8)}") and report.collective_bytes == 0


def test_backward_dot_from_contracting():
    """BackwardDotFromContracting: the rhs has no layout; the lhs's contracting split and
    the dot's batch and N splits give it [2,2,2]."""
    def f(a, b):
        a = split(a, f"devices=[2,2,2]{devices(8)}")
        return split(jnp.einsum("bmk,bnk->bmn", a, jnp.tanh(b)),
                     f"devices=[2,1,2,2]{devices(8)} last_tile_dim_replicate")
    low, _ = _run(f, rand(RNG, 4, 8, 16), rand(RNG, 4, 8, 16))
    assert low.program.params[1].sharding == xla(f"devices=[2,2,2]{devices(8)}")


def test_einsum_choose_larger_operand():
    """EinsumChooseLargerOperand (a convolution as an einsum, scaled down): the lhs splits
    M 4 ways, the much larger rhs N and its minor dim 2x2 over the same devices; the
    rhs's split is kept and only the small lhs gathered (was: the lhs's, 3,328 B; now
    1,024 B)."""
    layout, report = _einsum("bmk,bnkj->bmnj", "devices=[1,4,1]0,1,2,3", "devices=[1,2,1,2]0,1,2,3",
                             (4, 8, 8), (4, 18, 8, 4))
    assert layout == xla("devices=[1,1,2,2]0,1,2,3")
    assert dict(report.counts()) == {"all-gather": 1} and report.collective_bytes == 4 * 8 * 8 * 4


def test_einsum_choose_batch_first():
    """EinsumChooseBatchFirst: the lhs splits M, the larger rhs the batch dim, over the
    same 2 devices: the batch split is kept, the lhs turned to it by an all-to-all (was:
    the lhs's, 5,120 B; now 512 B)."""
    layout, report = _einsum("bmk,bnkj->bmnj", "devices=[1,2,1]0,1", "devices=[2,1,1,1]0,1",
                             (4, 8, 8), (4, 18, 8, 4))
    assert layout == xla("devices=[2,1,1,1]0,1")
    assert dict(report.counts()) == {"all-to-all": 1} and report.collective_bytes == 512


def test_einsum_lhs_batch_partitioned():
    """EinsumLHSBatchPartitioned: the lhs's batch split reaches the rhs and the result."""
    def f(a, b):
        return jnp.einsum("bmk,bnk->bmn", split(a, "devices=[2,1,1]0,1"), jnp.tanh(b))
    low, report = _run(f, rand(RNG, 4, 6, 8), rand(RNG, 4, 10, 8))
    assert low.program.params[1].sharding == xla("devices=[2,1,1]0,1")
    assert low.sharding_of(0) == xla("devices=[2,1,1]0,1") and report.collective_bytes == 0


def test_dynamic_slice_forward_and_backward_pass():
    """DynamicSliceForwardPass / BackwardPass: a split of a dim the slice keeps whole
    passes through both ways."""
    def forward(x, i):
        return jnp.tanh(lax.dynamic_slice(split(x, "devices=[1,1,2]0,1"), (0, i, 0), (11, 1, 15)))

    def backward(x, i):
        return split(lax.dynamic_slice(jnp.tanh(x), (0, i, 0), (11, 1, 15)), "devices=[1,1,2]0,1")
    low, _ = _run(forward, rand(RNG, 11, 13, 15), np.int32(4))
    assert low.sharding_of(0) == xla("devices=[1,1,2]0,1")
    low, _ = _run(backward, rand(RNG, 11, 13, 15), np.int32(4))
    assert low.program.params[0].sharding == xla("devices=[1,1,2]0,1")


def test_dynamic_update_slice_passes():
    """DynamicUpdateSliceForwardPassBase / ForwardPassUpdate: the base's or the update's
    split of a dim the update spans reaches the other and the result."""
    def from_base(x, u, i):
        return lax.dynamic_update_slice(split(x, "devices=[1,1,2]0,1"), jnp.tanh(u), (0, i, 0))

    def from_update(x, u, i):
        return lax.dynamic_update_slice(jnp.tanh(x), split(u, "devices=[1,1,2]0,1"), (0, i, 0))
    for f, other in [(from_base, 1), (from_update, 0)]:
        low, _ = _run(f, rand(RNG, 11, 13, 15), rand(RNG, 11, 1, 15), np.int32(4))
        assert low.sharding_of(0) == xla("devices=[1,1,2]0,1")
        assert low.program.params[other].sharding == xla("devices=[1,1,2]0,1")


def test_gather_from_data_operand_and_to_index():
    """GatherFromDataOperand: the input's split of the offset dim reaches the gather.
    GatherToIndex: the gather's split of its batch dim reaches the indices."""
    def from_data(x, idx):
        return jnp.tanh(split(x, "devices=[1,2]0,1")[idx])

    def to_index(x, idx):
        return split(x[jnp.abs(idx)], "devices=[2,1]0,1")
    low, _ = _run(from_data, rand(RNG, 2, 9), np.array([1, 0, 1], np.int32))
    assert low.sharding_of(0) == xla("devices=[1,2]0,1")
    low, _ = _run(to_index, rand(RNG, 2, 9), np.array([1, 0, 1], np.int32))
    assert low.program.params[1].sharding == xla("devices=[2]0,1")


def test_reduce_window_backward_pass():
    """ReduceWindowBackwardPass: a [2,1] split of a windowed sum's result reaches its operand."""
    def f(x):
        y = lax.reduce_window(jnp.tanh(x), 0.0, lax.add, (3, 2), (2, 1), [(1, 1), (0, 1)])
        return split(y, "devices=[2,1]0,1")
    low, _ = _run(f, rand(RNG, 13, 17))
    assert low.program.params[0].sharding == xla("devices=[2,1]0,1")


@pytest.mark.parametrize("spec", ["devices=[2,2]0,1,2,3", f"devices=[2,2,2]{devices(8)} last_tile_dim_replicate"],
                         ids=["PadForwardPass", "PartialReplicatedPadForwardPass"])
def test_pad_forward_pass(spec: str):
    """[11, 17] split [2,2] (or partially tiled), padded 2_4_1 x 1_1_2 (interior too):
    the pad keeps its operand's split."""
    def f(x, v):
        return lax.pad(split(x, spec), v, [(2, 4, 1), (1, 1, 2)])
    low, _ = _run(f, rand(RNG, 11, 17), np.float32(0.5))
    assert low.sharding_of(0) == xla(spec)


def test_concat_from_user_unsharded_dim():
    """ConcatFromUserUnshardedDim: a split of the dim the concatenate keeps reaches both operands."""
    def f(a, b):
        return split(jnp.concatenate([jnp.tanh(a), jnp.tanh(b)], axis=0), "devices=[1,2]0,1")
    low, _ = _run(f, rand(RNG, 8, 128), rand(RNG, 8, 128))
    assert all(p.sharding == xla("devices=[1,2]0,1") for p in low.program.params)
