"""Pallas kernels (pallas_call): a JAX primitive run as it is, as XLA runs a custom call.

A kernel works on whatever arrays it is given, so it is partitioned as XLA partitions a
custom call without sharding rules: its operands gathered, the whole kernel run on
every device (replicate_fallback). Inside a manual region (jax.shard_map, where library
kernels such as MaxText's splash attention run) the code is per-device and so is the
kernel: each device runs it on its own blocks, with no communication.

It runs where jax can run it: the sim backend on each device's NumPy arrays
(interpret=True kernels; others are refused clearly), under no context mesh; the jax
backend binds the primitive in its per-device program (on the hardware the kernel
targets, or anywhere with interpret=True), under that program's. Its body's and index
maps' equations are moved into that context from where they were traced (jax checks each
equation's recorded context mesh against its operands').

Reports price it as one kernel: the FLOPs of its body's matmuls on each step of its grid
(or its own cost_estimate where it gives one) at the matmul efficiency, its operands
and results read and written once through HBM, nothing held beyond its results, no
producer fused into it (XLA fuses nothing into a custom call).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.extend import core as jcore

from gspmd.errors import ShardingError
from gspmd.ops.convert import BoundPrimitive, call_eagerly, closed_in, in_context
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
    def run():
        with jax.sharding.use_abstract_mesh(_NO_MESH):   # NumPy arrays: no mesh for jax to check them against
            return call_eagerly(instr, args, _bound_in(instr.attrs["call"], _NO_MESH))
    if instr.attrs["call"].params.get("interpret"):
        return run()    # its own errors are the kernel's, as under jax.jit
    try:
        return run()
    except Exception as e:   # a kernel for hardware this machine has not, compiled for it
        raise ShardingError(
            f"The Pallas kernel {instr.attrs['kernel']!r} cannot run on this machine ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). The sim backend runs kernels written with "
            "interpret=True; plan this program (lower() and report() need no run) or run it with backend='jax' "
            "on the hardware the kernel is written for.") from e


def _lower(instr, args, lc):
    return _bound_in(instr.attrs["call"], jax.sharding.get_abstract_mesh())(*args)   # every axis manual


_NO_MESH = jax.sharding.AbstractMesh((), ())


@functools.lru_cache(maxsize=256)   # the same parameters each time: jax's own caches hit
def _bound_in(call: BoundPrimitive, mesh) -> BoundPrimitive:
    """The kernel as it binds under context mesh `mesh` (the jax backend's per-device
    program's; none on the sim backend). jax runs each equation of its body and index
    maps under the context recorded where they were traced (in a shard_map, or with
    automatic axes) and refuses values typed for another."""
    grid = call.params["grid_mapping"]
    maps = tuple(dataclasses.replace(b, index_map_jaxpr=closed_in(b.index_map_jaxpr, mesh))
                 for b in grid.block_mappings)
    return BoundPrimitive(call.primitive, {**call.params, "jaxpr": in_context(call.params["jaxpr"], mesh),
                                           "grid_mapping": dataclasses.replace(grid, block_mappings=maps)})


register("pallas-call",
         frontend=Frontend(converts={"pallas_call": _convert}),
         semantics=Semantics(evaluate=_evaluate, lower=_lower),
         rule=Rule(partition=replicate_fallback),
         timing=Timing(flops=lambda instr: instr.attrs["flops"], compute=ComputeKind.MATMUL, fuses=False))
