"""The randomized differential suites, run on the jax backend: the same random programs,
layouts and checks (their helpers, with gspmd.jit defaulting to backend="jax"), on meshes
of at most 8 devices (jax has 8 CPU devices here). A few cases by default, more with -m slow."""
import functools
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

import gspmd
from test_dot_partition import einsum_cases, run_case
from test_layout_partition import REDUCERS, reduce_cases, run
from test_reshard import lower_and_check, reshard_cases, reshard_program

JAX_DEVICES = 8


@contextmanager
def jax_backend_by_default():
    with mock.patch.object(gspmd, "jit", functools.partial(gspmd.jit, backend="jax")):
        yield


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))


def _einsum(case):
    assume(case[2].size <= JAX_DEVICES)
    with jax_backend_by_default():
        run_case(*case)


def _reshard(case):
    src_mesh, src_map, dst_mesh, dst_map, shape = case
    assume(src_mesh.size <= JAX_DEVICES)
    x = np.random.RandomState(0).standard_normal(shape).astype(np.float32)
    with jax_backend_by_default():
        lower_and_check(reshard_program(src_mesh, src_map, dst_mesh, dst_map), x, mesh=src_mesh)


def _reduce(case):
    shape, dims, name, mesh, in_map, out_map = case
    assume(mesh.size <= JAX_DEVICES)
    x = (np.random.RandomState(0).standard_normal(shape) * 0.5 + 1).astype(np.float32)
    fn = REDUCERS[name]
    with jax_backend_by_default():
        run(lambda a: fn(a, axis=dims), x, mesh, in_map, out_map, fn(x.astype(np.float64), axis=dims))


SUITES = [(einsum_cases, _einsum), (reshard_cases, _reshard), (reduce_cases, _reduce)]


@pytest.mark.parametrize("cases, body", SUITES, ids=["einsum", "reshard", "reduce"])
def test_random_programs_on_jax(cases, body):
    given(cases())(_settings(15)(body))()


@pytest.mark.slow
@pytest.mark.parametrize("cases, body", SUITES, ids=["einsum", "reshard", "reduce"])
def test_many_random_programs_on_jax(cases, body):
    given(cases())(_settings(300)(body))()
