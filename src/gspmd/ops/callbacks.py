"""Host callbacks: jax.debug.print, jax.debug.callback, jax.pure_callback, io_callback;
and jax.debug.inspect_array_sharding, which hears gspmd's layout of its value.

A callback sees the global values it sees under jax.jit: its operands are gathered first
(the one op whose rule is "gather, run whole": the host function reads the whole value).
The host function runs once per execution of the instruction — the sim backend calls it
from the interpreter with device 0's copy; the jax backend binds JAX's own primitive
inside the shard_map on device 0 only (an ordered io_callback keeps its order) and
hands device 0's results to every device; but a pure_callback, which JAX may call any
number of times, on every device, so that one that raises (equinox's error_if) fails
everywhere instead of leaving the other devices waiting for device 0's results (an
io_callback's host function that raises is caught on device 0, and a flag sent with its
results has every device raise it again). Results
are replicated values, split afterwards without communication where their users want
them split.

Inside a manual region (gspmd.manual, shard_map) the code is per-device, and so is the
callback, as in jax.shard_map: each device calls it with its own values.

Debug prints and io callbacks have side effects: no pass drops or merges them (an
unused pure_callback may go, as under jax.jit). `partitioned=True` debug callbacks
also see the global value, which JAX allows (it promises nothing about the shards).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from gspmd.errors import ShardingError
from gspmd.ir.program import SIDE_EFFECT
from gspmd.mesh import Mesh
from gspmd.ops.convert import BoundPrimitive, call_eagerly
from gspmd.ops.registry import Frontend, Rule, Semantics, register, replicate_fallback
from gspmd.sharding import Sharding
from gspmd.spmd.cost import Pattern


def _convert(side_effect: bool):
    def convert(b, eqn, args):
        out_types = [b.out_aval(eqn, i) for i in range(len(eqn.outvars))]
        attrs = {SIDE_EFFECT: True} if side_effect else {}
        return b.add("host-callback", args, out_types, call=BoundPrimitive(eqn.primitive, dict(eqn.params)),
                     per_device=bool(b.manual_regions), **attrs)
    return convert


def _ordered_debug(call: BoundPrimitive) -> bool:
    """jax.debug.print/callback(ordered=True), which JAX runs on one device only (an
    ordered io_callback is fine)."""
    if call.primitive.name == "debug_print":
        return call.params["ordered"]
    return type(call.params.get("effect")).__name__ == "OrderedDebugEffect"


def _evaluate_all(instr, per_device: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Once, with device 0's operands (every device holds the whole value); in a manual
    region once per device."""
    if instr.attrs["per_device"]:
        return [call_eagerly(instr, args) for args in per_device]
    results = call_eagerly(instr, per_device[0])
    return [results for _ in per_device]


def _lower(instr, args, lc):
    if _ordered_debug(instr.attrs["call"]):
        raise ShardingError(
            f"{instr.attrs['call']!r}(ordered=True) cannot run on the jax backend: JAX supports ordered debug "
            "effects on one device only. Pass ordered=False (the call still runs once, with the global value) "
            "or run with backend='sim', which keeps the order.")
    if _on_each_device(instr):
        return [jnp.asarray(r, o.dtype) for r, o in zip(instr.attrs["call"](*args), instr.outputs)]
    failure, outputs, call = _HostFailure(), instr.outputs, instr.attrs["call"]
    if _sends_results(instr):
        outputs, call = [*outputs, _FAILED], failure.guard(call)

    def on_device_0():
        return [jnp.asarray(r, o.dtype) for r, o in zip(call(*args), outputs)]

    def elsewhere():
        return [jnp.zeros(o.shape, o.dtype) for o in outputs]
    results = [lax.all_gather(r, lc.axis)[0] for r in lax.cond(lc.axis_index() == 0, on_device_0, elsewhere)]
    if not _sends_results(instr):
        return results
    *results, failed = results
    lax.cond(failed != 0, lambda: io_callback(failure.raise_again, None), lambda: None)
    return results   # device 0's results, everywhere


def _sends_results(instr) -> bool:
    """An io_callback, whose results device 0 sends to every device after calling it."""
    return "result_avals" in instr.attrs["call"].params


class _HostFailure:
    """What a host function that device 0 alone calls raised, raised again on every
    device: had device 0 alone failed, the others would wait forever for its results."""
    def __init__(self):
        self.error: Optional[BaseException] = None

    def guard(self, call: BoundPrimitive) -> BoundPrimitive:
        """`call` whose host function never raises: it keeps the exception and returns
        zeros instead, and one more result (_FAILED), 1 where it raised."""
        callback, avals = call.params["callback"], call.params["result_avals"]

        def guarded(*args):
            try:
                return [*callback(*args), np.int32(0)]
            except Exception as e:
                self.error = e
                return [*(np.zeros(a.shape, a.dtype) for a in avals), np.int32(1)]
        return BoundPrimitive(call.primitive, {**call.params, "callback": guarded,
                                               "result_avals": (*avals, jax.core.ShapedArray((), np.int32))})

    def raise_again(self) -> None:
        if self.error is None:   # another process's device 0 failed
            raise RuntimeError("a host callback raised on device 0, in another process")
        raise self.error


_FAILED = jax.ShapeDtypeStruct((), np.int32)   # the guarded call's flag: did the host function raise?


def _on_each_device(instr) -> bool:
    """Does the jax backend call on every device? In a manual region each device's own
    call; a pure function, which may run any number of times, without waiting for device 0."""
    return instr.attrs["per_device"] or instr.attrs["call"].primitive.name == "pure_callback"


def _lowered_collectives(instr, num_devices: int) -> list[tuple[Pattern, int]]:
    """_lower's gather of device 0's results (every device's copy stacked), unless each
    device calls on its own."""
    if _on_each_device(instr):
        return []
    flag = [_FAILED.dtype.itemsize] if _sends_results(instr) else []
    return [(Pattern.ALL_GATHER, num_devices * nbytes) for nbytes in [*(o.nbytes for o in instr.outputs), *flag]]


# -- jax.debug.inspect_array_sharding: the layout gspmd chose, at compile time ----------------
def _convert_inspect(b, eqn, args):
    # gspmd.jit's mesh says which jax device each device id is (its own, for a jax mesh)
    b.add("inspect-sharding", args, [], callback=eqn.params["callback"], mesh=b.mesh, **{SIDE_EFFECT: True})
    return []


def _partition_inspect(ctx, instr, operands, targets) -> list:
    """Call the user's callback with the operand's layout as it is here (after
    completion), once, when the program is partitioned, as jax calls it when it compiles;
    nothing runs at run time."""
    (x,) = operands
    instr.attrs["callback"](as_jax_sharding(x.sharding, instr.attrs["mesh"]))
    return []


def as_jax_sharding(sharding: Sharding, mesh: Optional[Mesh] = None):
    """`sharding` as a jax.sharding.NamedSharding over the jax devices of its device ids
    (`mesh`'s where it numbers them, else jax's in order; a mesh axis per tensor dim,
    "d0", "d1", ..., and one for the replicas); gspmd's own Sharding where jax has fewer
    devices (a plan for more devices than this machine)."""
    n = sharding.num_devices
    if n > len(jax.devices()):
        return sharding
    devices = mesh.jax_devices() if mesh is not None and mesh.size == n else jax.devices()[:n]
    names = tuple(f"d{d}" for d in range(sharding.rank)) + ("replicas",)
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object)[sharding.tile_assignment], names)
    spec = jax.sharding.PartitionSpec(*(name if t > 1 else None for name, t in zip(names, sharding.tiles)))
    return jax.sharding.NamedSharding(mesh, spec)


register("inspect-sharding",
         frontend=Frontend(converts={"inspect_sharding": _convert_inspect}),
         semantics=Semantics(evaluate=lambda instr, args, device: [], lower=lambda instr, args, lc: []),
         rule=Rule(partition=_partition_inspect))
register("host-callback",
         frontend=Frontend(converts={"debug_print": _convert(True), "debug_callback": _convert(True),
                                     "io_callback": _convert(True), "pure_callback": _convert(False)}),
         semantics=Semantics(evaluate_all=_evaluate_all, lower=_lower, lowered_collectives=_lowered_collectives),
         rule=Rule(partition=replicate_fallback))
