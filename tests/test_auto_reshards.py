"""The search's reshard model (autoshard/costs.py Pricing) against the partitioner's
planner (spmd/reshard.py): where they agree, and where they do not.

The search prices a reshard as its own short recipe over mesh axes (the axes each dim
keeps stay; the others move by all-to-all to the dim that takes them, or are gathered),
which is fast enough for hundreds of thousands of layouts; the planner searches chains
of cuts, gathers, all-to-alls and exchanges (the search pricing with the planner itself
found the same plans for benchmarks/bench_auto.py's MLP, 2-layer Transformer and MoE
layer on 8 devices, in 2.3x, 4.4x and 10.8x the time). On shapes whose shards nest they agree
exactly on the transitions one collective does (a dim gathering its minor axes, one
axis moving by all-to-all) on torus networks; on switched networks the planner gathers
across hosts for less. Elsewhere they differ both ways. On 1832 random pairs of layouts
(meshes of 8 to 64 devices, tpu-v3 and a100), the search's price / the planner's:
- shapes every split divides: equal 52-63%, dearer 31-44% (95th percentile 1.6-2.3x,
  at most 6.2x: it all-to-alls or gathers whole where the planner cuts first or does
  with fewer collectives), cheaper 5% (down to 0.17x: it moves a dim's major axis by
  one all-to-all, which the partitioner's all-to-all cannot; the xfail below);
- uneven shapes: equal ~30%, dearer ~30%, cheaper ~40% (down to 0.22x: it takes
  uneven shards to nest, so it calls free what takes the planner an exchange)."""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gspmd
from gspmd.autoshard.costs import Pricing
from gspmd.spmd import cost as cm
from gspmd.spmd import reshard as rs

MESH_SHAPES = [(2, 4), (4, 2), (2, 2, 2), (4, 4), (2, 8), (8, 8), (4, 16)]


def _mesh(shape, hw) -> gspmd.Mesh:
    """The mesh laid onto the network as the search lays it."""
    return gspmd.Mesh(cm.device_mesh(shape, hw), tuple("abcd"[:len(shape)]))


def _sharding(mesh, layout, shape) -> gspmd.Sharding:
    return gspmd.Sharding.from_mesh(mesh, [axes if axes else None for axes in layout], shape)


@st.composite
def one_collective_reshards(draw, hardware):
    """(hardware, mesh, shape, src, dst): dims that every split divides, and dst one
    all-gather (a dim drops its minor axes) or one all-to-all (a dim's minor axis becomes
    the minor axis of another dim) away from src."""
    hw = cm.profile(draw(st.sampled_from(hardware)))
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    rank = draw(st.integers(1, 3))
    n = math.prod(mesh_shape)
    shape = tuple(draw(st.sampled_from([n, 2 * n])) for _ in range(rank))
    src = [[] for _ in range(rank)]
    for axis in draw(st.permutations(range(len(mesh_shape)))):
        dim = draw(st.integers(-1, rank - 1))
        if dim >= 0:
            src[dim].append(axis)
    split = [d for d in range(rank) if src[d]]
    if not split:
        src[0].append(0)
        split = [0]
    dim = draw(st.sampled_from(split))
    dst = [list(axes) for axes in src]
    if rank > 1 and draw(st.booleans()):
        to = draw(st.sampled_from([d for d in range(rank) if d != dim]))
        dst[to].append(dst[dim].pop())
    else:
        dst[dim] = dst[dim][:draw(st.integers(0, len(src[dim]) - 1))]
    freeze = lambda layout: tuple(tuple(axes) for axes in layout)   # noqa: E731
    return hw, _mesh(mesh_shape, hw), shape, freeze(src), freeze(dst)


def _both(hw, mesh, shape, src, dst) -> tuple[float, float]:
    """(the search's price, the planner's) of resharding float32 `shape` from src to dst."""
    searched = Pricing(mesh, hw).reshard_seconds(src, dst, shape, 4)
    planned = rs.cost(_sharding(mesh, src, shape), _sharding(mesh, dst, shape), shape, 4, hw)
    return searched, planned


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(one_collective_reshards(["tpu-v3", "tpu-v4"]))
def test_one_collective_reshards_on_a_torus_cost_what_the_planner_plans(case):
    searched, planned = _both(*case)
    assert searched == pytest.approx(planned, rel=1e-9), case


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(one_collective_reshards(["a100", "h100"]))
def test_on_switched_networks_the_planner_is_never_dearer(case):
    searched, planned = _both(*case)
    assert planned <= searched * (1 + 1e-9), case


def test_the_planner_gathers_across_hosts_for_less():
    # 8 hosts of 8 GPUs (GPU meshes are laid out row-major: axis 0 runs across the
    # hosts), that axis gathered: the search prices one all-gather over the hosts; the
    # planner's plan costs two thirds of that.
    hw = cm.profile("h100")
    searched, planned = _both(hw, _mesh((8, 8), hw), (128,), ((0,),), ((),))
    assert planned == pytest.approx(searched * 2 / 3, rel=1e-3)


@pytest.mark.xfail(strict=True, reason="the search moves a dim's major axis by all-to-all, which the "
                   "partitioner's all-to-all (minor factors only) cannot: it prices swapping two dims' "
                   "splits at 56 us, the planner's plan costs 421 us")
def test_swapping_two_dims_splits_costs_what_the_planner_plans():
    hw = cm.profile("tpu-v3")
    searched, planned = _both(hw, _mesh((8, 8), hw), (256, 256, 128), ((0,), (1,), ()), ((1,), (0,), ()))
    assert searched == pytest.approx(planned, rel=1e-9)
