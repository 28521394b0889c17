"""The shared cost model (spmd/cost.py): ring, torus, all-to-all and permute formulas on
small topologies, compute rooflines, and the partitioner pricing its choices with it."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd.spmd import cost as cm
from gspmd.spmd.cost import Pattern

BW, HOP, FIXED = 10e9, 1e-6, 5e-6


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=0)


def torus(*shape, per_chip=1, bw=BW):
    """A hardware whose network is exactly `shape` (devices per chip along the last dim)."""
    net = cm.Torus(bw, HOP, ndim=len(shape), devices_per_chip=per_chip)
    hw = cm.Hardware("test", 1e12, 1 << 30, 1e11, net, collective_overhead_s=FIXED)
    assert hw.network(int(np.prod(shape))).shape == shape
    return hw


def rate(pattern, groups, hw, n=None):
    """The rate over `groups`, in a program over n devices (default: the groups' devices)."""
    groups = np.asarray(groups)
    return cm.rate(pattern, groups, n or groups.size, hw)


def test_network_shapes_follow_the_chips():
    v3 = cm.PROFILES["tpu-v3"]
    assert v3.network(2048).shape == (32, 64)       # 32 x 32 chips, 2 cores each
    assert v3.network(128).shape == (8, 16)
    assert v3.network(64).shape == (4, 16)          # a v3-64 slice: 4 x 8 chips
    assert cm.PROFILES["tpu-v4"].network(4096).shape == (16, 16, 16)
    assert cm.PROFILES["h100"].network(64).shape == (8, 8)     # 8 hosts of 8
    assert cm.PROFILES["h100"].network(4).shape == (4,)


def test_full_ring_all_gather_sends_k_minus_1_chunks_each_way_round():
    hw = torus(8)
    r = rate(Pattern.ALL_GATHER, [range(8)], hw)
    # 7 steps of 1/8 of the result, half clockwise and half counter-clockwise, 1 hop each.
    assert r.per_byte == approx(7 / 8 / 2 / BW)
    assert r.latency == approx(FIXED + 7 * HOP)
    rs, ar = rate(Pattern.REDUCE_SCATTER, [range(8)], hw), rate(Pattern.ALL_REDUCE, [range(8)], hw)
    assert rs.per_byte == approx(8 * r.per_byte)        # its input is 8 x its result
    assert ar.per_byte == approx(2 * r.per_byte)        # reduce-scatter + all-gather
    assert ar.latency == approx(2 * r.latency)


def test_rings_that_do_not_wrap_share_links():
    hw = torus(8)
    whole = rate(Pattern.ALL_GATHER, [range(8)], hw)
    halves = rate(Pattern.ALL_GATHER, [range(4), range(4, 8)], hw, n=8)
    # Each half closes its ring over 3 hops back through its own links: those carry 2 edges.
    assert halves.per_byte == approx(3 / 4 * 2 / 2 / BW)
    assert halves.latency == approx(FIXED + 3 * 3 * HOP)
    strided = rate(Pattern.ALL_GATHER, [range(0, 8, 2), range(1, 8, 2)], hw, n=8)
    assert strided.per_byte == approx(3 / 4 * 2 / 2 / BW)   # 2 hops per edge, 2 groups per link
    assert whole.per_byte < strided.per_byte


def test_sub_grid_groups_run_one_phase_per_dim():
    hw = torus(4, 4)
    ids = np.arange(16).reshape(4, 4)
    r = rate(Pattern.ALL_GATHER, [ids.ravel()], hw)
    # Along the minor dim: 3 steps of 1/16; then along the major dim: 3 steps of 1/4.
    assert r.per_byte == approx((3 / 16 + 3 / 4) / 2 / BW)
    assert r.latency == approx(FIXED + 6 * HOP)
    # Not a sub-grid (a diagonal): one ring in the listed order, routed x then y.
    diagonal = rate(Pattern.ALL_GATHER, [[0, 5, 10, 15]], hw, n=16)
    assert diagonal.latency == approx(FIXED + 3 * 2 * HOP)


def test_cores_of_a_chip_share_its_links_across_the_minor_dim():
    hw = torus(2, 4, per_chip=2)            # 2 x 2 chips, 2 cores each
    net = hw.network(8)
    assert [d.bandwidth for d in net.dims] == [BW / 2, BW]
    ids = np.arange(8).reshape(2, 4)
    along_chips = rate(Pattern.ALL_GATHER, ids, hw)
    across = rate(Pattern.ALL_GATHER, ids.T, hw)
    assert along_chips.per_byte == approx(3 / 4 / 2 / BW)
    assert across.per_byte == approx(1 / 2 / 2 / (BW / 2))


def test_all_to_all_is_bisection_bound():
    hw = torus(8)
    r = rate(Pattern.ALL_TO_ALL, [range(8)], hw)
    # 1/8 of the data to each other member; a ring of 8: hops summed over ordered pairs
    # = 8 * 16, spread over 2 links per member.
    assert r.per_byte == approx(8 * 16 / 8 / (2 * 8) / BW)
    # On a 2D torus the cost grows with the side, not the device count.
    square = rate(Pattern.ALL_TO_ALL, [range(64)], torus(8, 8))
    line = rate(Pattern.ALL_TO_ALL, [range(64)], torus(64))
    assert square.per_byte == approx(r.per_byte)
    assert line.per_byte == approx(8 * r.per_byte)


def test_permutes_cost_the_busiest_link():
    hw = torus(8)
    ring = np.arange(8)
    shift = np.stack([ring, np.roll(ring, -1)], 1)
    assert rate(Pattern.PERMUTE, shift, hw, n=8) == cm.Rate(FIXED + HOP, 1 / BW)
    far = np.stack([ring, np.roll(ring, -2)], 1)
    assert rate(Pattern.PERMUTE, far, hw, n=8) == cm.Rate(FIXED + 2 * HOP, 2 / BW)
    assert rate(Pattern.PERMUTE, np.stack([ring, ring], 1), hw, n=8) == cm.Rate(0.0, 0.0)


def test_gpu_hosts_nvlink_inside_network_across():
    h100 = cm.PROFILES["h100"]
    ids = np.arange(16).reshape(2, 8)
    inside = rate(Pattern.ALL_GATHER, ids, h100)
    across = rate(Pattern.ALL_GATHER, ids.T, h100)
    # A port sends both ways round through one link: (k-1)/k of the result at its bandwidth.
    assert inside.per_byte == approx(7 / 8 / (0.8 * 450e9))   # NVLink at what NCCL gets of it
    assert across.per_byte == approx(1 / 2 / 50e9)
    everything = rate(Pattern.ALL_TO_ALL, [range(16)], h100)
    assert everything.per_byte == approx(8 / 16 / 50e9)   # half the data leaves the host


def test_gpu_cluster_all_reduce_runs_as_hierarchical_rings():
    """Over 8 nodes of 8 A100s: reduce-scatter inside each node over NVLink, an all-reduce
    of the node's 1/8 across the nodes (each GPU over its own NIC, the 8 rings at once),
    all-gather inside the node: NCCL's hierarchical ring."""
    a100 = cm.PROFILES["a100"]
    nvlink, ib, fixed = 0.8 * 300e9, 25e9, a100.collective_overhead_s
    everything = rate(Pattern.ALL_REDUCE, [range(64)], a100)
    node_rings = 2 * (7 / 8) / nvlink                    # reduce-scatter, then all-gather, of the whole
    cross_node = 2 * (7 / 8) * (1 / 8) / ib              # all-reduce of 1/8 of it across 8 nodes
    assert everything.per_byte == approx(node_rings + cross_node)
    assert everything.latency == approx(2 * fixed + 2 * 7 * (3e-6 + 10e-6))
    # The same all-reduce as one flat ring over 64 GPUs would push 2 x 63/64 through the NICs.
    assert everything.per_byte < 2 * (63 / 64) / ib / 4


def test_data_parallel_rings_across_nodes_use_a_nic_per_gpu():
    a100 = cm.PROFILES["a100"]
    ids = np.arange(64).reshape(8, 8)            # hosts x GPUs; a data-parallel group per local rank
    one = rate(Pattern.ALL_REDUCE, ids[:, :1].T, a100, n=64)
    all_eight = rate(Pattern.ALL_REDUCE, ids.T, a100, n=64)
    assert one.per_byte == approx(2 * 7 / 8 / 25e9)
    assert all_eight == one                      # eight NICs per node: the rings do not share one


def test_tpu_v5p_profile():
    v5p = cm.PROFILES["tpu-v5p"]
    assert (v5p.flops_per_s, v5p.memory_bytes, v5p.hbm_bytes_per_s) == (459e12, 96 * cm.GiB, 2.765e12)
    assert v5p.usable_bytes == 95 * cm.GiB       # what jax reports a v5p chip has
    assert v5p.network(2048).shape == (8, 16, 16)   # a 3D torus of chips, one device each
    ring = rate(Pattern.ALL_GATHER, [range(16)], v5p, n=2048)    # along the minor torus dim
    assert ring.per_byte == approx(15 / 16 / 2 / 100e9)          # both ways round, 100 GB/s links
    plane = rate(Pattern.ALL_GATHER, [range(256)], v5p, n=2048)  # a 16 x 16 plane: two phases
    assert plane.per_byte == approx(15 / 256 / 2 / 100e9 + 15 / 16 / 2 / 100e9)


def test_device_mesh_on_gpu_hosts_keeps_the_minor_axis_inside_a_node():
    mesh = cm.device_mesh((2, 32, 8), "a100")    # pipeline x data x tensor over 64 nodes
    assert np.array_equal(mesh, np.arange(512).reshape(2, 32, 8))
    assert set(mesh[0, 0] // 8) == {0}           # a tensor group is one node


def test_compute_roofline():
    hw = cm.PROFILES["tpu-v3"]
    big = cm.compute_seconds(cm.ComputeKind.MATMUL, 1e12, 1e6, hw)
    assert big == approx(1e12 / (hw.flops_per_s * hw.matmul_efficiency))
    streamed = hw.hbm_bytes_per_s * hw.memory_efficiency
    thin = cm.compute_seconds(cm.ComputeKind.MATMUL, 1e6, 1e9, hw)
    assert thin == approx(1e9 / streamed)       # memory-bound
    assert cm.compute_seconds(cm.ComputeKind.MEMORY, 1e9, 1e9, hw) == approx(1e9 / streamed)
    assert cm.compute_seconds(cm.ComputeKind.FREE, 1e9, 1e9, hw) == 0


def test_unknown_profiles_are_a_clear_error():
    with pytest.raises(gspmd.ShardingError, match="tpu-v3"):
        cm.profile("abacus")
    with pytest.raises(gspmd.ShardingError, match="tpu-v3"):
        gspmd.jit(lambda x: x, hardware="abacus")


def test_the_partitioner_prices_plans_on_the_hardware_given():
    # x splits the contracted dim over the 2 hosts, w over the 8 GPUs of a host: one of
    # them is gathered, and the partial sums are all-reduced over the other axis. On
    # h100 hosts (NVLink inside, a slower network across) the big gather stays inside
    # the hosts; where hosts talk faster than their devices do, it crosses them.
    mesh = gspmd.Mesh(np.arange(16).reshape(2, 8), ("host", "gpu"))

    def f(x, w):
        return gspmd.mesh_split(x, mesh, [-1, "host"]) @ gspmd.mesh_split(w, mesh, ["gpu", -1])

    args = (jax.ShapeDtypeStruct((64, 256), np.float32), jax.ShapeDtypeStruct((256, 64), np.float32))
    inverted = cm.Hardware("inverted", 1e15, 80 << 30, 3e12, cm.Hosts(8, 1e9, 1e-6, 1e12, 1e-6))

    def plan(hw):
        """Per collective kind, whether its groups cross hosts."""
        report = gspmd.jit(f, hardware=hw).lower(*args).report()
        assert report.hardware is cm.profile(hw) and report.step_seconds > 0
        return {(c.kind, any(len({d // 8 for d in g}) > 1 for g in c.groups)) for c in report.collectives}

    # (On h100 the gather inside the hosts may take two steps: their rings are latency-bound.)
    assert plan("h100") == {("all-gather", False), ("all-reduce", True)}
    assert plan(inverted) == {("all-gather", True), ("all-reduce", False)}


def test_device_mesh_lays_each_axis_along_the_torus():
    v3 = cm.PROFILES["tpu-v3"]
    assert np.array_equal(cm.device_mesh((4, 16), v3), np.arange(64).reshape(4, 16))   # the slice itself
    tall = cm.device_mesh((16, 4), v3)               # on a 4 x 16 torus: axes swapped
    assert np.array_equal(tall, np.arange(64).reshape(4, 16).T)
    deep = cm.device_mesh((4, 16, 4), v3)            # 256 devices on 8 x 32: factors of dims
    assert sorted(deep.ravel()) == list(range(256))
    assert np.array_equal(cm.device_mesh((3, 5), v3), np.arange(15).reshape(3, 5))   # no fit: row-major


def test_collectives_overlap_independent_compute_up_to_the_hardware_share():
    import dataclasses

    mesh = gspmd.Mesh(np.arange(8), ("x",))

    def f(a, b, w):
        gathered = gspmd.mesh_split(gspmd.mesh_split(a, mesh, ["x", -1]), mesh, [-1, -1])
        return gathered, b @ w          # the dot does not wait for the all-gather

    args = [jax.ShapeDtypeStruct(s, np.float32) for s in [(4096, 1024), (1024, 1024), (1024, 1024)]]
    low = gspmd.jit(f).lower(*args)
    assert low.report().counts() == {"all-gather": 1}

    def timing(overlap):
        r = low.report(hardware=dataclasses.replace(cm.PROFILES["tpu-v3"], overlap=overlap))
        return r.compute_seconds, r.communication_seconds, r.step_seconds

    compute, comm, hidden = timing(1.0)
    assert hidden == approx(max(compute, comm))
    assert timing(0.0)[2] == approx(compute + comm)
    assert timing(0.5)[2] == approx(max(compute + comm / 2, comm))


def test_element_wise_producers_fuse_into_matmuls_on_tpus_not_on_gpus():
    """A softmax feeding a matmul: XLA:TPU computes it inside the dot that reads it; a
    GPU's library matmul reads its operand from HBM, so the softmax is a kernel of its
    own that reads the scores and writes the probabilities."""
    import dataclasses

    def f(scores, v):
        return jax.nn.softmax(scores, axis=-1) @ v

    n = 2048
    args = [jax.ShapeDtypeStruct((n, n), np.float32), jax.ShapeDtypeStruct((n, 64), np.float32)]
    low = gspmd.jit(f).lower(*args)
    tpu = dataclasses.replace(cm.PROFILES["a100"], fuses_into_matmul=True)
    fused, unfused = low.report(hardware=tpu), low.report(hardware="a100")
    dot = 2 * n * n * 64 / (tpu.flops_per_s * tpu.matmul_efficiency)
    scores = n * n * 4 / (tpu.hbm_bytes_per_s * tpu.memory_efficiency)
    assert fused.compute_seconds < dot + scores          # the dot reads the scores once, nothing else
    # unfused: the softmax's passes read the scores at least once and write the probabilities
    assert unfused.compute_seconds >= fused.compute_seconds + 2 * scores * 0.99
    assert not cm.PROFILES["a100"].fuses_into_matmul and cm.PROFILES["tpu-v3"].fuses_into_matmul


def test_an_optimization_barrier_splits_a_fused_chain():
    """An element-wise chain is one kernel that reads its input and writes its result;
    through an optimization barrier (XLA fuses nothing across one) it is two, and the
    value between them is written to HBM and read back."""
    def chain(x, barrier):
        y = jnp.sin(x)
        return jnp.exp(jax.lax.optimization_barrier(y) if barrier else y)

    x = jax.ShapeDtypeStruct((1024, 1024), np.float32)
    hw = cm.PROFILES["a100"]
    fused, split = (gspmd.jit(functools.partial(chain, barrier=b)).lower(x).report(hardware=hw).compute_seconds
                    for b in (False, True))
    once = x.size * 4 / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    assert fused == approx(2 * once)
    assert split == approx(4 * once)


def test_a_kernel_hashing_random_bits_takes_its_arithmetic_time_where_that_is_longer():
    """Dropout on a GPU: jax hashes one counter pair per 32-bit value (threefry's 80
    vector instructions), fused into the kernel that applies the mask, which takes the
    longer of its bytes and its arithmetic: on an A100 the rounds outlast the bytes of a
    float32 input and its result. Profiles without a vector rate (TPUs) time the bytes."""
    def dropout(x, key):
        return x * jax.random.bernoulli(key, 0.9, x.shape).astype(x.dtype)

    n, hw = 1 << 22, cm.PROFILES["a100"]
    key = jax.eval_shape(jax.random.key, 0)
    low = gspmd.jit(dropout).lower(jax.ShapeDtypeStruct((n,), np.float32), key)
    rounds, nbytes = n * 80 / hw.vector_ops_per_s, 2 * n * 4 / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    assert rounds > nbytes
    assert low.report(hardware=hw).compute_seconds == pytest.approx(rounds, rel=1e-3)
    bytes_only = dataclasses.replace(hw, vector_ops_per_s=None)
    assert low.report(hardware=bytes_only).compute_seconds == pytest.approx(nbytes, rel=1e-3)
    assert cm.PROFILES["tpu-v5p"].vector_ops_per_s is None
    # a kernel whose bytes outlast its rounds keeps its bytes' time: 16 float32 values a hash
    wide = gspmd.jit(lambda x, key: x * jax.random.bernoulli(key, 0.9, x.shape[:1])[:, None]).lower(
        jax.ShapeDtypeStruct((n // 16, 16), np.float32), key)
    assert wide.report(hardware=hw).compute_seconds == pytest.approx(nbytes, rel=1e-3)
    # a scalar the hash shares with another fusion (a loop counter's index) does not join
    # their kernels: the other's bytes do not hide the rounds
    def two_kernels(x, big, key, i):
        j = i * 2
        return dropout(x, jax.random.fold_in(key, j)), jnp.exp(big * j.astype(big.dtype))
    big = jax.ShapeDtypeStruct((4 * n,), np.float32)
    both = gspmd.jit(two_kernels).lower(jax.ShapeDtypeStruct((n,), np.float32), big, key,
                                        jax.ShapeDtypeStruct((), np.int32))
    assert both.report(hardware=hw).compute_seconds == pytest.approx(rounds + 4 * nbytes, rel=1e-2)


def test_an_update_added_in_place_reads_and_writes_its_slice_once():
    """acc.at[i].add(g): one fused kernel reads the accumulator's slice and g and writes
    the slice back, in place (XLA's dynamic-update-slice fusion); the slice is not
    written to HBM and read again in between. A slice a matmul reads is (a GPU's
    library matmul reads its operands from HBM)."""
    n, hw = 1024, cm.PROFILES["a100"]
    pass_ = n * n * 4 / (hw.hbm_bytes_per_s * hw.memory_efficiency)    # one [n, n] float32 pass
    args = [jax.ShapeDtypeStruct((8, n, n), np.float32), jax.ShapeDtypeStruct((n, n), np.float32),
            jax.ShapeDtypeStruct((), np.int32)]
    added = gspmd.jit(lambda acc, g, i: acc.at[i].add(g), donate_argnums=0).lower(*args)
    assert added.report(hardware=hw).compute_seconds == pytest.approx(3 * pass_, rel=1e-3)
    sliced = gspmd.jit(lambda acc, g, i: jax.lax.dynamic_index_in_dim(acc, i, keepdims=False) @ g).lower(*args)
    dot = 2 * n ** 3 / (hw.flops_per_s * hw.matmul_efficiency)
    assert sliced.report(hardware=hw).compute_seconds == pytest.approx(dot + 2 * pass_, rel=1e-3)


def test_a_conditional_in_a_loop_counts_the_branches_its_counter_takes():
    """A branch that the loop's counter alone selects (a pipeline's loss, taken in the
    steps that finish a microbatch) is timed for the trips that take it: 3 of 12 here,
    not every trip."""
    def f(x, w):
        return jax.lax.fori_loop(2, 14, lambda t, c: jax.lax.cond(t % 4 == 0, lambda c: c @ w, lambda c: c, c), x)

    n, hw = 1024, cm.PROFILES["a100"]
    low = gspmd.jit(f).lower(*[jax.ShapeDtypeStruct((n, n), np.float32)] * 2)
    dot = 2 * n ** 3 / (hw.flops_per_s * hw.matmul_efficiency)
    assert low.report(hardware=hw).compute_seconds == pytest.approx(3 * dot, rel=1e-3)

    def by_data(x, w, k):     # an index the counter does not decide: every branch counted
        return jax.lax.fori_loop(0, 12, lambda t, c: jax.lax.cond(k > t, lambda c: c @ w, lambda c: c, c), x)
    low = gspmd.jit(by_data).lower(*[jax.ShapeDtypeStruct((n, n), np.float32)] * 2, jax.ShapeDtypeStruct((), np.int32))
    assert low.report(hardware=hw).compute_seconds == pytest.approx(12 * dot, rel=1e-3)
