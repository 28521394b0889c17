"""The element-wise epilogue of an SPMD program (an optimizer's update of every
parameter), which the jax backend runs on global arrays after its shard_map.

Why: XLA's sharding passes take time quadratic in a shard_map's operands and results
(Shardy's import looks the operands up per use in the body, the SPMD partitioner copies
the tuple of result shardings per result). A 48-layer train step hands its 1,308
parameters and optimizer states in and out; without its update, 437 values go in and
439 (the gradients) come out, and XLA compiles it ~3.5 s faster (benchmarks/RESULTS.md).
An element-wise update needs no communication: XLA partitions it as it does jax.jit's
own programs.

An instruction joins the epilogue when
- its op is element-wise and reads nothing of the device it runs on (or it is a scalar
  constant);
- every instruction that reads its result is in the epilogue;
- its result's global value is known (a program output, or an operand of the epilogue of
  that shape) and laid out evenly, as a NamedSharding can hold it (no padding to mask);
- each operand of rank > 0 has that shape and layout (a parameter: given in it), and each
  scalar is the same on every device: a parameter, a constant, the result of an
  all-reduce over all devices, or computed from such scalars alone (a per-device
  scalar, an offset, would be one value to the global program); a broadcast of such a
  scalar is read as the scalar, broadcast to each shape that reads it.
The per-device values it reads leave the shard_map laid out as they are used: element by
element, the global op then computes what each device computed.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
from jax import lax

from gspmd import ops
from gspmd.ir import Instr, Program, Value
from gspmd.ops.loop_motion import Uniformity
from gspmd.ops.registry import Storage, elementwise_factors
from gspmd.sharding import Sharding


def liftable(instr: Instr) -> bool:
    """An instruction that computes on global values what it computes per device: an
    element-wise op (whose lowering reads nothing of the device it runs on) or a scalar
    literal."""
    op = ops.lookup(instr.opcode)
    if len(instr.outputs) != 1 or instr.has_side_effect:
        return False
    return ((op.rule.factors is elementwise_factors and op.memory.storage is Storage.ELEMENTWISE)
            or (op.memory.storage is Storage.LITERAL and instr.outputs[0].rank == 0))


class Epilogue:
    """`spmd` split into `core` (run per device) and `instrs` (the epilogue, run on global
    values). `core.params` are spmd's parameters at `arguments`; `core.outputs` are spmd's
    outputs that the epilogue does not make, then the values it reads from the core, as
    `read` global values (one per layout it reads a value in). `global_of` maps each
    per-device value the epilogue makes to its global value; an operand that splats a
    scalar the same on every device (a broadcast constant, which serves parameters of
    every shape) is read as that scalar, broadcast where it is used."""

    def __init__(self, spmd: Program, params: Sequence[Value], outputs: Sequence[Value], num_devices: int,
                 exact: Callable[[Value], bool]):
        """`params`, `outputs`: spmd's as global values; exact(global value): whether a
        NamedSharding holds its layout as it is."""
        self.spmd, self._exact_layout, self._exact_of = spmd, exact, {}
        self._params = dict(zip(spmd.params, params))
        self._everywhere = np.arange(num_devices)[None, :]
        self._uniform = Uniformity(spmd, np.arange(num_devices), follows=lambda o: o.rank == 0)
        self._scalar = Value("scalar", (), np.float32)      # the global value of every scalar read
        self._scalar.sharding = Sharding.replicated(0, num_devices)
        self.splats: dict[Value, Value] = {}     # operand -> the scalar it splats
        wanted: dict[Value, dict[tuple, Value]] = {}     # value -> the global values the epilogue reads it as
        for local, g in zip(spmd.outputs, outputs):
            wanted.setdefault(local, {})[_layout(g)] = g
        self.global_of: dict[Value, Value] = {}
        tail = self._tail(wanted)
        self.made = set(self.global_of)
        self.instrs = [i for i in spmd.instrs if i in tail and i.outputs[0] in self.made]
        self.core = Program("core")
        self.core.instrs = [i for i in spmd.instrs if i not in tail]
        self.core.outputs = [o for o in spmd.outputs if o not in self.made]
        self.read = {}
        for o in dict.fromkeys(self.splats.get(o, o) for i in self.instrs for o in i.operands):
            if o.producer is not None and o not in self.made:
                for layout, g in wanted[o].items():
                    self.read[o, layout] = g
                    self.core.outputs.append(o)
        used = {o for i in self.core.instrs for o in i.operands} | set(self.core.outputs)
        self.arguments = [k for k, p in enumerate(spmd.params) if p in used]
        self.core.params = [spmd.params[k] for k in self.arguments]

    def _tail(self, wanted: dict[Value, dict[tuple, Value]]) -> set[Instr]:
        """The epilogue's instructions (and the splats it reads as scalars), from the
        program's end backwards: an instruction joins once all its readers have."""
        users: dict[Value, list[Instr]] = {}
        for instr in self.spmd.instrs:
            for o in instr.operands:
                users.setdefault(o, []).append(instr)
        tail: set[Instr] = set()
        for instr in reversed(self.spmd.instrs):
            out = instr.outputs[0] if instr.outputs else None
            if out is None or not all(u in tail for u in users.get(out, ())):
                continue
            if out in self.splats and out not in wanted:
                tail.add(instr)                  # read only as its scalar: nothing left to run
                continue
            layouts = wanted.get(out, {})
            if len(layouts) != 1 or not liftable(instr):
                continue
            g = next(iter(layouts.values()))
            if self._exact(g) and self._operands_fit(instr, g):
                self.global_of[out] = g
                for o in instr.operands:
                    scalar = self._splat(o)
                    if scalar is not None:
                        self.splats[o] = o = scalar
                    read = self._as(o, g)
                    wanted.setdefault(o, {})[_layout(read)] = read
                tail.add(instr)
        return tail

    def _exact(self, g: Value) -> bool:
        layout = _layout(g)
        if layout not in self._exact_of:
            self._exact_of[layout] = self._exact_layout(g)
        return self._exact_of[layout]

    def _as(self, operand: Value, g: Value) -> Value:
        """The global value (its shape and layout) an operand of an instruction making g
        is read as: g's, or a replicated scalar."""
        return g if operand.rank else self._scalar

    def _operands_fit(self, instr: Instr, g: Value) -> bool:
        """Each operand can be read as a global value laid out as g (a parameter: given
        in that layout), or is a scalar the same on every device, or splats one."""
        for o in instr.operands:
            if o.rank == 0:
                if not self._same_everywhere(o):
                    return False
            elif o.shape != instr.outputs[0].shape:
                return False
            elif o.producer is None and not (_layout(self._params[o]) == _layout(g) and self._exact(g)):
                return False
        return True

    def _splat(self, v: Value) -> Optional[Value]:
        """The scalar, the same on every device, that v repeats in every element."""
        p = v.producer
        if p is None or v.rank == 0 or not ops.splats(p):
            return None
        return p.operands[0] if self._same_everywhere(p.operands[0]) else None

    def _same_everywhere(self, v: Value) -> bool:
        """Whether scalar v is the same on every device (computed from scalars alone)."""
        return self._uniform(v, self._everywhere)

    def run(self, arguments: Sequence, core_results: Sequence, lower: Callable) -> list:
        """spmd's outputs as global arrays: its arguments and the core's results in,
        each epilogue instruction lowered by lower(instr, args) on global values."""
        env = dict(zip(self.spmd.params, arguments))
        env.update(zip(self.read, core_results[len(core_results) - len(self.read):]))
        for instr in self.instrs:
            out = instr.outputs[0]
            g = self.global_of[out]
            operands = [self._params.get(o) or self.global_of.get(o) or self._as(o, g) for o in instr.operands]
            on_globals = Instr(instr.opcode, operands, instr.attrs)
            on_globals.outputs = [Value(out.name, g.shape, out.dtype)]
            env[out] = lower(on_globals, [self._read(env, o, x) for o, x in zip(instr.operands, operands)])[0]
        core = iter(core_results)
        return [env[o] if o in self.made else next(core) for o in self.spmd.outputs]

    def _read(self, env: dict, o: Value, as_global: Value):
        """Operand o of an epilogue instruction, read as the global value `as_global`."""
        if o in self.splats:       # one broadcast per scalar and shape
            key = (o, as_global.shape)
            if key not in env:
                scalar = self.splats[o]
                env[key] = lax.broadcast(self._read(env, scalar, self._scalar), as_global.shape)
            return env[key]
        return env[o] if o in env else env[o, _layout(as_global)]


def _layout(v: Value) -> tuple:
    return v.shape, v.sharding


