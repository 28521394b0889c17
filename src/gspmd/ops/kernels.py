"""Pallas kernels (pallas_call): a JAX primitive run as it is, as XLA runs a custom call.

A kernel works on whatever arrays it is given, so it is partitioned as XLA partitions a
custom call without sharding rules: its operands gathered, the whole kernel run on
every device (replicate_fallback). Inside a manual region (jax.shard_map, where library
kernels such as MaxText's splash attention run) the code is per-device and so is the
kernel: each device runs it on its own blocks, with no communication.

It runs where jax can run it: the sim backend on each device's NumPy arrays
(interpret=True kernels; others are refused clearly); the jax backend binds the
primitive in its per-device program (on the hardware the kernel targets, or anywhere
with interpret=True), its body's equations moved into that program's context (jax
checks each equation's recorded context mesh against its operands', and a kernel
traced where some axes were automatic recorded those).

Reports price it as one kernel: the FLOPs of its body's matmuls on each step of its grid
(or its own cost_estimate where it gives one) at the matmul efficiency, its operands
and results read and written once through HBM, nothing held beyond its results, no
producer fused into it (XLA fuses nothing into a custom call).
"""
from __future__ import annotations

import math

import jax
from jax.extend import core as jcore

from gspmd.errors import ShardingError
from gspmd.ops.convert import BoundPrimitive, call_eagerly
from gspmd.ops.registry import ComputeKind, Frontend, Rule, Semantics, Timing, register, replicate_fallback


def _convert(b, eqn, args):
    out_types = [b.out_aval(eqn, i) for i in range(len(eqn.outvars))]
    return b.add("pallas-call", args, out_types, call=BoundPrimitive(eqn.primitive, dict(eqn.params)),
                 kernel=eqn.params.get("name") or "kernel", flops=_kernel_flops(eqn.params))


def _kernel_flops(params: dict) -> int:
    """The kernel's own cost_estimate where it gives one, else its body's matmul FLOPs on
    every step of its grid (each branch of a conditional at its dearest: a causal mask's
    skipped blocks count)."""
    estimate = params.get("cost_estimate")
    if estimate is not None:
        return int(estimate.flops)
    return _body_flops(params["jaxpr"]) * math.prod(int(g) for g in params["grid_mapping"].grid)


def _body_flops(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contracting)
        elif name == "cond":
            total += max(_body_flops(branch.jaxpr) for branch in eqn.params["branches"])
        elif name == "scan":
            total += _body_flops(eqn.params["jaxpr"].jaxpr) * int(eqn.params["length"])
        else:   # while loops (trips unknown: once), pjit and other calls
            total += sum(_body_flops(inner) for inner in jcore.jaxprs_in_params(eqn.params))
    return total


def _evaluate(instr, args, device):
    if instr.attrs["call"].params.get("interpret"):
        return call_eagerly(instr, args)    # its own errors are the kernel's, as under jax.jit
    try:
        return call_eagerly(instr, args)
    except Exception as e:   # a kernel for hardware this machine has not, compiled for it
        raise ShardingError(
            f"The Pallas kernel {instr.attrs['kernel']!r} cannot run on this machine ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). The sim backend runs kernels written with "
            "interpret=True; plan this program (lower() and report() need no run) or run it with backend='jax' "
            "on the hardware the kernel is written for.") from e


def _lower(instr, args, lc):
    call = instr.attrs["call"]
    body = _in_context(call.params["jaxpr"], jax.sharding.get_abstract_mesh())
    return BoundPrimitive(call.primitive, {**call.params, "jaxpr": body})(*args)


def _in_context(jaxpr, mesh):
    """`jaxpr` with every equation's recorded context (sub-jaxprs' too) that of `mesh`:
    where the kernel is bound (the per-device program, every axis manual), not where it
    was traced."""
    def moved(ctx):
        with ctx.manager, jax.sharding.use_abstract_mesh(mesh):
            return type(ctx)()     # the recorded context but for its mesh

    def param(value):
        if isinstance(value, tuple):
            return tuple(map(param, value))
        if isinstance(value, jcore.ClosedJaxpr):
            return value.replace(jaxpr=_in_context(value.jaxpr, mesh))
        return _in_context(value, mesh) if isinstance(value, jcore.Jaxpr) else value

    return jaxpr.replace(eqns=[eqn.replace(ctx=moved(eqn.ctx), params={k: param(v) for k, v in eqn.params.items()})
                               for eqn in jaxpr.eqns])


register("pallas-call",
         frontend=Frontend(converts={"pallas_call": _convert}),
         semantics=Semantics(evaluate=_evaluate, lower=_lower),
         rule=Rule(partition=replicate_fallback),
         timing=Timing(flops=lambda instr: instr.attrs["flops"], compute=ComputeKind.MATMUL, fuses=False))
