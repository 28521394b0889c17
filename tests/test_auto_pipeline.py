"""gspmd.auto on a step whose layers are a stack (a lax.scan over stacked parameters):
a pipeline where one wins (deep and narrow, slow links between hosts), none where it
loses (wide and shallow); the chosen plan, run by plan.jit() or by the code it
writes, equals one device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from gspmd.autoshard import stacks
from gspmd.models.stacked import example_inputs, make_train_step as make_step
from gspmd.spmd.cost import GiB, Hosts
from util import assert_close

# Hosts of two devices joined by a slow network (1 GB/s, 50 us), NVLink-like inside.
SLOW_HOSTS = gspmd.Hardware("slow-hosts", 312e12, 80 * GiB, 2e12, Hosts(2, 300e9, 3e-6, 1e9, 50e-6))
DEEP = example_inputs(width=64, layers=8, batch=16)


@pytest.fixture(scope="module")
def deep_plan():
    return gspmd.auto(make_step(), *DEEP, devices=8, hardware=SLOW_HOSTS, verify=1)


def test_a_deep_narrow_stack_over_slow_hosts_is_pipelined(deep_plan):
    """Data parallel sums every layer's gradient over all hosts, on the slow network; a
    pipeline sums each stage's share of them over the fewer devices of its stage and
    passes the (small) activations between stages."""
    assert deep_plan.pipeline is not None
    stack, how = deep_plan.pipeline
    assert stack.layers == 8 and deep_plan.mesh.axis_names == ("stage", "x")
    assert deep_plan.mesh.shape[0] == how.stages > 1
    kinds = deep_plan.collectives
    assert kinds["collective-permute"][0] >= 2 and "all-reduce" in kinds
    unpipelined = next(u for u in deep_plan.runner_ups if u.description.startswith("no pipeline"))
    assert unpipelined.extra_seconds > 0
    assert "pipeline:" in str(deep_plan)


def test_the_pipelined_plan_runs_equal_to_one_device(deep_plan):
    partitioned = deep_plan.jit()
    assert partitioned.lower(*DEEP).report().step_seconds == pytest.approx(deep_plan.step_seconds)
    assert_close(partitioned(*DEEP), jax.jit(make_step())(*DEEP), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_pipelined_plan_runs_on_jax_devices(deep_plan):
    assert_close(deep_plan.jit(backend="jax")(*DEEP), jax.jit(make_step())(*DEEP), rtol=1e-4, atol=1e-5)


def test_the_code_a_pipelined_plan_writes_runs_it(deep_plan):
    """plan.code() defines the mesh and pipelined_layers, which the user calls in place
    of the scan: the same plan, equal to one device."""
    code = deep_plan.code()
    assert "gspmd.pipeline(" in code and "def pipelined_layers(layer, carry, stacked):" in code
    namespace: dict = {}
    exec(code, namespace)
    pasted = gspmd.jit(make_step(scan=namespace["pipelined_layers"]), mesh=namespace["mesh"],
                       memory_limit=deep_plan.memory_limit, hardware=SLOW_HOSTS)
    report = pasted.lower(*DEEP).report()
    assert (report.step_seconds, report.peak_memory_bytes) == (deep_plan.step_seconds, deep_plan.peak_memory_bytes)
    assert_close(pasted(*DEEP), jax.jit(make_step())(*DEEP), rtol=1e-4, atol=1e-5)


def test_a_wide_shallow_step_is_not_pipelined():
    """Two wide layers: the bubble and the stage shifts cost more than they save."""
    args = example_inputs(width=512, layers=2, batch=128, abstract=True)
    plan = gspmd.auto(make_step(), *args, devices=8, hardware=SLOW_HOSTS, verify=1)
    assert plan.pipeline is None
    assert all(not u.description.startswith("no pipeline") for u in plan.runner_ups)


@pytest.mark.parametrize("how,layers", [(stacks.Pipelining(4, 4), 8), (stacks.Pipelining(2, 4, "circular", 2), 8),
                                        (stacks.Pipelining(4, 2), 4)])
def test_a_pipelined_stack_equals_the_scan(how, layers):
    """Every microbatch through every layer in order, each stage's layers whole on its
    devices (a run of layers per pipeline layer where stages * repeats < layers); their
    gradients summed over the data axis once, after the pipeline's loops."""
    args = example_inputs(width=16, layers=layers, batch=16)
    stack = stacks.find_stack(make_step(), args)
    mesh = stacks.pipeline_mesh(8, how.stages, SLOW_HOSTS)
    step = gspmd.jit(stacks.pipelined(make_step(), stack, how, mesh), mesh=mesh)
    assert_close(step(*args), jax.jit(make_step())(*args), rtol=1e-4, atol=1e-5)
    low = step.lower(*args)
    assert low.sharding_of("params['layers']['w']").tiles[0] == how.stages
    in_loops = [c.kind for c in low.report().collectives if c.within]
    assert set(in_loops) == {"collective-permute"}, in_loops


def test_only_a_scan_over_stacked_parameters_is_a_stack():
    """A scan over per-example inputs (time steps of a batch) or one that returns
    per-layer outputs is no stack of layers."""
    params, x, _ = DEEP
    stack = stacks.find_stack(make_step(), DEEP)
    assert (stack.layers, stack.carry.shape, stack.parameter_bytes) == (8, (16, 64), 8 * (64 * 64 + 64) * 4)
    assert "models/stacked.py:" in stack.where

    def recurrent(w, inputs, h):
        return jax.lax.scan(lambda h, u: (jnp.tanh(h @ w + u), None), h, inputs)[0].sum()

    def with_outputs(params, x):
        return jax.lax.scan(lambda h, p: (jnp.tanh(h @ p["w"]), h), x @ params["embed"], params["layers"])[1].sum()

    assert stacks.find_stack(recurrent, (np.ones((4, 4), np.float32), np.ones((5, 3, 4), np.float32),
                                         np.ones((3, 4), np.float32))) is None
    assert stacks.find_stack(with_outputs, (params, x)) is None


@pytest.mark.slow
def test_a_deep_narrow_stack_over_32_a100s_is_pipelined():
    """A100 hosts of 8 (25 GB/s between them): 32 layers of width 256 on 32 devices."""
    args = example_inputs(width=256, layers=32, batch=64, features=16, abstract=True)
    plan = gspmd.auto(make_step(), *args, devices=32, hardware="a100", verify=2)
    assert plan.pipeline is not None
