"""Differential testing: a partitioned program must equal the single-device program."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

import gspmd
import gspmd.analysis
from gspmd.frontend.annotation import unpartitioned


def assert_close(actual, expected, rtol=1e-4, atol=1e-4):
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, (a_tree, e_tree)
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def assert_same(actual, expected, rtol=0.0, atol=0.0):
    """Equal leaves, dtypes and key types; bit for bit, but float leaves only to rtol/atol
    where those are given."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, (a_tree, e_tree)
    for a, e in zip(a_leaves, e_leaves):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
        if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        a, e = np.asarray(a), np.asarray(e)
        if (rtol or atol) and jax.dtypes.issubdtype(e.dtype, np.floating):
            np.testing.assert_allclose(a.astype(np.float32), e.astype(np.float32), rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(a, e)


# Every differential check runs on each of these backends (e.g. GSPMD_TEST_BACKENDS=sim).
BACKENDS = tuple(os.environ.get("GSPMD_TEST_BACKENDS", "sim,jax").split(","))


# TPU v3 without latencies: plans priced by their bytes alone. Tests of a strategy that
# pays off in bandwidth use it with arrays small enough to test quickly, on which a real
# network's per-collective latency would favour fewer, larger collectives.
BANDWIDTH_BOUND = dataclasses.replace(gspmd.analysis.PROFILES["tpu-v3"], name="bandwidth-bound",
                                      interconnect=gspmd.analysis.Torus(45e9, 0.0, devices_per_chip=2),
                                      collective_overhead_s=0.0)


# Every device on one crossbar, no latencies: a collective costs the bytes each device
# receives over its port (and a negligible fixed cost, so that fewer collectives win
# ties). Tests that a plan moves only what it must use it.
BYTES_RECEIVED = dataclasses.replace(gspmd.analysis.PROFILES["tpu-v3"], name="bytes-received",
                                     interconnect=gspmd.analysis.Hosts(1 << 20, 45e9, 0.0, 45e9, 0.0),
                                     collective_overhead_s=1e-12)


def check(fn, *args, mesh=None, rtol=1e-4, atol=1e-4, backends=BACKENDS, hardware=None) -> gspmd.Lowered:
    """Run fn partitioned on each backend and on one device; assert equal; return the
    Lowered. `hardware`: what the partitioner prices its choices on (default tpu-v3)."""
    with unpartitioned():
        expected = jax.jit(fn)(*args)
    for backend in backends:
        partitioned = gspmd.jit(fn, mesh=mesh, backend=backend, hardware=hardware)
        assert_close(partitioned(*args), expected, rtol, atol)
    return partitioned.lower(*args)


def check_priced(fn, *args, backends=BACKENDS):
    """check() with the plan priced by the bytes each device receives: (Lowered, report)."""
    low = check(fn, *args, hardware=BYTES_RECEIVED, backends=backends)
    return low, low.report()


def rand(rng: np.random.RandomState, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)




def in_a_fresh_process(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Python `code` run in a process of its own (8 CPU devices, gspmd importable): for
    XLA bugs that abort or hang the process, which must not take pytest with them."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, returncode=-1, stdout=str(e.stdout), stderr=f"timed out after {timeout} s")
