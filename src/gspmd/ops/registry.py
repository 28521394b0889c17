"""The op registry: ONE record per opcode holding all of its knowledge, a small record
per concern — the JAX primitives it comes from (Frontend), its reference semantics and
jax lowering (Semantics), its dimension factors, from which propagation and
partitioning derive, and, where data moves between shards, hand-written propagation or
partition rules (Rule), what reports count (Timing), how it occupies memory (Memory,
Kernel), what rewrites may do with it (Rewrites), and what generic code would otherwise
ask by its name (Facets). Family modules (ops/elementwise.py, ops/dot.py, ...) register
their ops; the drivers (frontend, propagation, partitioner, runtime) and passes only
look records up."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Collection, Hashable, Optional, Sequence, Union

import jax
import numpy as np
from jax import numpy as jnp

from gspmd.errors import ShardingError
from gspmd.ir import Instr, Program, Value
from gspmd.ir.reducer import Reducer
from gspmd.ops.convert import Converter, LowerContext
from gspmd.sharding import Sharding
from gspmd.spmd import factors as fx
from gspmd.spmd import reshard as rs
from gspmd.spmd.cost import ComputeKind, Pattern
from gspmd.spmd.context import DeviceContext
from gspmd.spmd.partitioned import PartitionedValue
from gspmd.spmd.reshard_steps import empty

# evaluate(instr, operand arrays, device id) -> output arrays (one device)
Evaluate = Callable[[Instr, list[np.ndarray], int], list[np.ndarray]]
# evaluate_all(instr, per-device operand arrays) -> per-device outputs (collectives)
EvaluateAll = Callable[[Instr, list[list[np.ndarray]]], list[list[np.ndarray]]]
# evaluate_programs(instr, per-device operands, run(program, per-device args)) -> per-device
# outputs (ops with sub-programs, which the interpreter runs for them)
EvaluatePrograms = Callable[[Instr, list[list[np.ndarray]], Callable], list[list[np.ndarray]]]
# lower(instr, operand arrays inside the jax backend's shard_map body, context) -> outputs
Lower = Callable[[Instr, list, LowerContext], list]
# propagate(instr, shardings of tensors(instr), target index) -> proposals for target
Propagate = Callable[[Instr, list[Optional[Sharding]], int], list[Sharding]]
Partition = Callable[[DeviceContext, Instr, list[PartitionedValue], list[Sharding]], list[PartitionedValue]]

# Propagation priorities (paper 3.5): lower runs first. EXPAND is for the direction of a
# layout op in which a smaller tensor would dictate the layout of a larger one (forward
# through broadcast, backward through reduce): the larger tensor should rather take its
# layout from its other neighbours.
ELEMENTWISE, LAYOUT, EXPAND, CONTRACTION = 0, 1, 2, 3


class Storage(Enum):
    """How an op's results occupy memory once XLA has compiled the per-device program
    (the memory model, analysis/memory.py, follows XLA's loop fusion and buffer reuse).
    A fusible op computes each element where its users read it: it gets no buffer of
    its own when every user is fused too."""
    MATERIALIZED = "materialized"   # a buffer of its own (dot, convolution, collectives, sort...)
    ELEMENTWISE = "elementwise"     # fusible; result element i reads operand element i, so the
                                    # result may overwrite an operand of its size that dies there
    INDEXED = "indexed"             # fusible; reads each operand element at most once (slice, transpose)
    REPEATED = "repeated"           # fusible; reads operand elements many times (broadcast, gather)
    IN_PLACE = "in place"           # fusible; writes into operand 0's buffer when it dies there
    UPDATED = "updated"             # a buffer of its own, or operand 0's when it dies there (scatter)
    BITCAST = "bitcast"             # fusible; stored, a view of an operand laid out row-major (reshape)
    CARRIED = "carried"             # results are the operands' buffers, updated in place (loops)
    VIEW = "view"                   # results are the operands themselves (optimization barriers)
    LITERAL = "literal"             # data compiled into the executable: no buffer at run time


@dataclass
class Frontend:
    """How JAX equations become this op."""
    # JAX primitive name -> how its equations become this op (and helpers around it)
    converts: dict[str, Converter] = field(default_factory=dict)
    # ... of primitives that take or make typed PRNG keys, which these converters see as
    # their uint32 key data (frontend/keys.py converts other primitives on keys word by word)
    converts_keys: dict[str, Converter] = field(default_factory=dict)


@dataclass
class Semantics:
    """What the op computes: its NumPy reference (one of the three forms) and its jax
    lowering."""
    evaluate: Optional[Evaluate] = None
    evaluate_all: Optional[EvaluateAll] = None
    evaluate_programs: Optional[EvaluatePrograms] = None
    lower: Optional[Lower] = None
    # lower_together = (key, lower_all): instructions with the same key(instr) (None: this
    # one alone) that no instruction between them reads run as one, lower_all(instrs,
    # args of each, lc) -> results of each (collectives a backend does not combine itself)
    lower_together: Optional[tuple[Callable[[Instr], Optional[Hashable]], Callable]] = None
    # lowered_collectives(instr, num_devices) -> the collectives `lower` runs, (pattern,
    # bytes per device) each, where not the op's own collective (Timing.collective) as it
    # is: a max all-reduce's NaN flags, a host callback's gather of device 0's results
    lowered_collectives: Optional[Callable[[Instr, int], list[tuple[Pattern, int]]]] = None


@dataclass
class Rule:
    """How the op is sharded: its dimension factors, from which propagation and the
    common partitioning derive, or hand-written rules where data moves between shards.
    An op with rules of its own declares its factors too where it can (what its tensors
    share: a reshape's several per dim, a loop's carries): gspmd.auto prices it by them."""
    factors: Optional[Callable[[Instr], list[fx.Factor]]] = None
    propagate: Optional[Propagate] = None
    partition: Optional[Partition] = None
    priority: int = ELEMENTWISE
    forward_priority: Optional[int] = None    # towards the outputs, when not `priority`
    backward_priority: Optional[int] = None   # towards the operands, when not `priority`
    # values of sub-programs that must share a layout with the op's own (loop carries)
    tied: Optional[Callable[[Instr], list[Value]]] = None
    # informants(instr, target) -> indices into tensors(instr) whose layouts can say
    # anything about the target's (default: all of them; a loop's carries are independent)
    informants: Optional[Callable[[Instr, int], Sequence[int]]] = None
    # seed(instr) -> (index into tensors(instr), layout) pairs the op fixes by itself,
    # propagated from the start like annotations (a manual region's specs)
    seed: Optional[Callable[[Instr], Sequence[tuple[int, Sharding]]]] = None


@dataclass
class Timing:
    """What reports count and time for one execution."""
    flops: Optional[Callable[[Instr], int]] = None   # arithmetic of one execution
    compute: ComputeKind = ComputeKind.MEMORY         # how reports time one execution (spmd/cost.py)
    # HBM bytes one execution reads and writes, where not its operands and results
    # (given the values that live in HBM: the others stay on chip within a fusion)
    bytes_accessed: Optional[Callable[[Instr, Collection[Value]], int]] = None
    collective: Optional[Pattern] = None              # a collective's communication pattern
    # a collective's bytes per device, where not its result's (collective_bytes)
    payload: Optional[Callable[[Instr], int]] = None
    # the sub-programs one execution runs, each with how often (a loop's trip count,
    # once for each branch of a conditional)
    runs: Optional[Callable[[Instr], list[tuple[Program, int]]]] = None
    # branch_shares(instr) -> for conditionals in what it runs, the share of their
    # executions that takes each branch, where the op knows it (a loop whose counter alone
    # decides the branch); timing counts every branch once where not
    branch_shares: Optional[Callable[[Instr], dict[Instr, list[float]]]] = None
    # whether a memory-bound op fuses with its neighbours (a matmul: takes in the
    # producers it reads); XLA fuses nothing across an optimization barrier, so what
    # enters one is written to HBM and read back after it, nor into a Pallas kernel
    fuses: bool = True
    # vector instructions of one execution, where they may outweigh its bytes (a hash's
    # rounds): its fused kernel takes the longer of its bytes and its arithmetic
    vector_ops: Optional[Callable[[Instr], int]] = None


@dataclass
class Memory:
    """How the op occupies memory once XLA has compiled it (analysis/memory.py)."""
    # how its results occupy memory (or storage(instr), where the instruction decides)
    storage: Union[Storage, Callable[[Instr], Storage]] = Storage.MATERIALIZED
    # too costly to recompute in each user (transcendentals, reductions): XLA fuses it
    # only into a single user that reads each element once
    expensive: Union[bool, Callable[[Instr], bool]] = False
    # bytes the op's kernel holds while it runs beyond its operands and results
    scratch: Optional[Callable[[Instr], int]] = None
    # expanded(instr) -> {operand index: n}: XLA:CPU reads these operands through a loop
    # fusion that writes n masked copies of each, one per group (a grouped matmul run as
    # one dense product); their element-wise producers fuse into it
    expanded: Optional[Callable[[Instr], dict[int, int]]] = None
    # combined_as(instr) -> a key: XLA:CPU's combiner runs independent instructions of one
    # key as one (all-reduces over the same groups by the same reducer)
    combined_as: Optional[Callable[[Instr], Hashable]] = None
    # cpu_unfused(instr) -> whether XLA:CPU stores a result other compilers fuse (a
    # concatenate of more than 8 operands)
    cpu_unfused: Optional[Callable[[Instr], bool]] = None


@dataclass
class Kernel:
    """How XLA's kernel for the op orders dims in memory."""
    orders: Optional[Callable[[Instr], "KernelOrders"]] = None
    transposes: bool = False      # only permutes dims: layout assignment can absorb it into its producer
    # row_major(instr): XLA:CPU's kernel rejects operands and results laid out otherwise
    # (its FFT's layout check), so that collectives along inner dims must not hand it theirs
    row_major: Optional[Callable[[Instr], bool]] = None


@dataclass
class Rewrites:
    """What passes and rules may do to the op."""
    # prune(instr, which results are used): drop what only unused results need
    prune: Optional[Callable[[Instr, list[bool]], None]] = None
    # repeat(ctx, instr) -> its result computed again by other instructions, which no
    # common-subexpression elimination merges with it (memory-aware partitioning)
    repeat: Optional[Callable[[DeviceContext, Instr], Value]] = None
    # linear(instr) -> sets of operand indices the op is jointly linear in while its other
    # operands stay fixed: the op commutes with summing those operands over devices
    # (loop motion defers an all-reduce past such ops)
    linear: Optional[Callable[[Instr], Sequence[Sequence[int]]]] = None


# Whether a value is the same on every device of each of the groups (rows of device ids).
Uniform = Callable[[Value, np.ndarray], bool]


@dataclass
class Facets:
    """What generic code (drivers, passes, chains of formatting ops) asks of an op that
    it would otherwise ask by opcode."""
    annotation: bool = False     # the user's layout for its result (attrs sharding, unspecified)
    identity: bool = False       # its result is operand 0 (annotations, copies)
    # layouts_named(instr) -> the layouts the user wrote in it (annotations, manual specs)
    layouts_named: Optional[Callable[[Instr], list[Sharding]]] = None
    # zero(instr, is_zero) -> whether its result is all zeros, given is_zero of values
    zero: Optional[Callable[[Instr, Callable[[Value], bool]], bool]] = None
    # splat(instr) -> whether its result repeats its one operand, a scalar, in every element
    splat: Optional[Callable[[Instr], bool]] = None
    # uniform(instr, groups, uniform) -> whether its result is the same on every device of
    # each group (default: when every operand is); loop motion asks
    uniform: Optional[Callable[[Instr, np.ndarray, Uniform], bool]] = None
    combines: Optional[Reducer] = None    # an element-wise combine of two values by this reducer
    # added_to(instr, acc, add, program) -> instructions computing acc + instr's result into
    # add's output, where instr updates zeros (its operand 0) and add sums the two
    added_to: Optional[Callable[[Instr, Value, Instr, Program], Optional[list[Instr]]]] = None
    # the one dim a pad/slice/concatenate/reverse changes, and its result's segments
    # along it (ops/formatting.py)
    segments: Optional["SegmentRule"] = None
    # position(instr, fixed, below) -> the dim along which every element of its result at
    # the positions `fixed` ({dim: index}) equals its own index along that dim (an
    # iota's; broadcasts, reshapes, converts... carry their operand's, asked of
    # below(operand, fixed)); None when not known. Gathers read such index components as
    # batching dims (ops/gather_scatter.py)
    position: Optional[Callable[[Instr, dict[int, int], Callable[[Value, dict[int, int]], Optional[int]]],
                                Optional[int]]] = None


@dataclass(frozen=True)
class SegmentRule:
    """An op of a chain of data formatting along one dim (ops/formatting.py): the dim it
    changes (None: several, or strides or dilation), and its result's segments along it
    from `below(operand)` (its operands' segments) and `fill(value)` (a fill's index)."""
    changed_dim: Callable[[Instr], Optional[int]]
    segments: Callable[[Instr, int, Callable[[Value], list], Callable[[Value], int]], list]


@dataclass
class OpDef:
    """One op's record, a sub-record per concern."""
    opcode: str
    frontend: Frontend = field(default_factory=Frontend)
    semantics: Semantics = field(default_factory=Semantics)
    rule: Rule = field(default_factory=Rule)
    timing: Timing = field(default_factory=Timing)
    memory: Memory = field(default_factory=Memory)
    kernel: Kernel = field(default_factory=Kernel)
    rewrites: Rewrites = field(default_factory=Rewrites)
    facets: Facets = field(default_factory=Facets)


Order = tuple[int, ...]   # a tensor's dims as laid out in memory, major to minor


@dataclass(frozen=True)
class KernelOrders:
    """How XLA's kernel for an op lays data out (for the memory model): per operand the
    dim orders it reads in place (None: any; an operand in another order is copied into
    the first, once for every op that wants that order), and the order it writes."""
    operands: tuple[Optional[tuple[Order, ...]], ...]
    result: Optional[Order] = None    # None: row-major
    # XLA:CPU's, where it expands the kernel into copies and a simpler kernel (a dot that
    # its DotDecomposer canonicalizes); None: `operands`
    cpu_operands: Optional[tuple[Optional[tuple[Order, ...]], ...]] = None


def same_order(shape: Sequence[int], stored: Optional[Order], wanted: Order) -> bool:
    """Whether data stored in one dim order (None: row-major) can be read in another
    without moving it (only size-1 dims differ)."""
    stored = tuple(range(len(shape))) if stored is None else stored
    return [d for d in stored if shape[d] != 1] == [d for d in wanted if shape[d] != 1]


def major_first(rank: int, dim: int) -> Order:
    """`dim` outermost, the others in order (how XLA lays out a collective's dim)."""
    return (dim, *(d for d in range(rank) if d != dim))


OPS: dict[str, OpDef] = {}
PRIMITIVES: dict[str, Converter] = {}   # every record's `converts`, by JAX primitive name
KEY_PRIMITIVES: set[str] = set()        # those from `converts_keys`

def register(opcode: str, **records) -> OpDef:
    """Record `opcode`; `records` are OpDef's sub-records by name (frontend=Frontend(...))."""
    assert opcode not in OPS, f"opcode {opcode!r} registered twice"
    op = OpDef(opcode, **records)
    converts, converts_keys = op.frontend.converts, op.frontend.converts_keys
    for name, convert in {**converts, **converts_keys}.items():
        assert name not in PRIMITIVES, f"JAX primitive {name!r} converted by two records"
        PRIMITIVES[name] = convert
    KEY_PRIMITIVES.update(converts_keys)
    OPS[opcode] = op
    return op


def lookup(opcode: str) -> OpDef:
    try:
        return OPS[opcode]
    except KeyError:
        raise ShardingError(f"Opcode {opcode!r} has no entry in the op registry.") from None


def priority(opcode: str, forward: bool) -> int:
    """When propagation through `opcode` towards its outputs (forward) or its operands
    runs, relative to other ops."""
    rule = lookup(opcode).rule
    directed = rule.forward_priority if forward else rule.backward_priority
    return rule.priority if directed is None else directed


def tensors(instr: Instr) -> list[Value]:
    """The values whose layouts `instr` relates: operands, outputs, then tied values."""
    tied = lookup(instr.opcode).rule.tied
    return instr.operands + instr.outputs + (tied(instr) if tied else [])


def wants_row_major(program: Program) -> bool:
    """Whether some op of `program` (or of a program nested in it) has an XLA:CPU kernel
    that takes only row-major layouts."""
    for instr in program.all_instrs():
        row_major = lookup(instr.opcode).kernel.row_major
        if row_major is not None and row_major(instr):
            return True
    return False


def storage(instr: Instr) -> Storage:
    """How `instr`'s results occupy memory once XLA has compiled it."""
    kind = lookup(instr.opcode).memory.storage
    return kind(instr) if callable(kind) else kind


def flops(instr: Instr) -> int:
    """The arithmetic of one execution of `instr` (0 where its record counts none)."""
    fn = lookup(instr.opcode).timing.flops
    return 0 if fn is None else fn(instr)


def collective_bytes(instr: Instr) -> int:
    """What a collective moves per device, as reports count and time it: its result's
    bytes, or its op's payload."""
    payload = lookup(instr.opcode).timing.payload
    return instr.output.nbytes if payload is None else payload(instr)


@dataclass(frozen=True)
class LoweringStep:
    """Instructions the jax backend lowers at one go: one alone, or (together) a group
    its record's lower_together runs as one."""
    instrs: tuple[Instr, ...]
    together: bool = False


def lowering_steps(program: Program) -> list[LoweringStep]:
    """The order in which the jax backend lowers `program`. Instructions whose records
    lower them together (collectives XLA does not combine) wait, with the instructions
    that read them, until an instruction that cannot wait (a sub-program, a side
    effect, another of them) reads one; then each waiting kind runs as one."""
    steps: list[LoweringStep] = []
    waiting: dict[object, list[Instr]] = {}
    deferred: list[Instr] = []
    pending: set[Value] = set()     # results of waiting and deferred instructions

    def flush():
        steps.extend(LoweringStep(tuple(group), together=True) for group in waiting.values())
        steps.extend(LoweringStep((instr,)) for instr in deferred)
        waiting.clear(), deferred.clear(), pending.clear()
    for instr in program.instrs:
        together = lookup(instr.opcode).semantics.lower_together
        key = together[0](instr) if together else None
        reads_pending = any(o in pending for o in instr.operands)
        if reads_pending and key is None and instr.outputs and not instr.has_side_effect and not runs(instr):
            deferred.append(instr)
        elif key is not None and not reads_pending:
            waiting.setdefault((instr.opcode, key), []).append(instr)
        else:
            if reads_pending:
                flush()
            if key is None:
                steps.append(LoweringStep((instr,)))
                continue
            waiting.setdefault((instr.opcode, key), []).append(instr)
        pending.update(instr.outputs)
    flush()
    return steps


def lowered_collectives(instr: Instr, num_devices: int) -> list[tuple[Pattern, int]]:
    """The collectives the jax backend runs for one execution of `instr` (pattern, bytes
    per device), before XLA's own rewrites: its lowering's, or its own collective."""
    op = lookup(instr.opcode)
    if op.semantics.lowered_collectives is not None:
        return op.semantics.lowered_collectives(instr, num_devices)
    return [] if op.timing.collective is None else [(op.timing.collective, collective_bytes(instr))]


def runs(instr: Instr) -> list[tuple[Program, int]]:
    """The sub-programs one execution of `instr` runs, each with how often."""
    fn = lookup(instr.opcode).timing.runs
    return [] if fn is None else fn(instr)


def seeds(instr: Instr) -> Sequence[tuple[int, Sharding]]:
    """Layouts `instr` fixes for its own tensors before any propagation."""
    fn = lookup(instr.opcode).rule.seed
    return () if fn is None else fn(instr)


def informants(instr: Instr, target: int, count: int) -> Sequence[int]:
    """Which of the `count` tensors(instr) propagation should consult for `target`."""
    fn = lookup(instr.opcode).rule.informants
    return range(count) if fn is None else fn(instr, target)


def propagate(instr: Instr, shardings: Sequence[Optional[Sharding]], target: int) -> Sequence[Sharding]:
    """Layouts that the other tensors(instr) imply for tensor `target`."""
    return proposer(instr)(shardings, target)


def proposer(instr: Instr) -> Callable[[Sequence[Optional[Sharding]], int], Sequence[Sharding]]:
    """propagate(instr, ...) as a function of (shardings, target), the op's factors
    worked out once (completion asks an instruction many times)."""
    rule = lookup(instr.opcode).rule
    if rule.propagate is not None:
        return lambda shardings, target: rule.propagate(instr, list(shardings), target)
    if rule.factors is None:
        return lambda shardings, target: []
    return _factor_proposer(tuple(rule.factors(instr)), tuple(v.rank for v in tensors(instr)))


@functools.lru_cache(maxsize=4096)
def _factor_proposer(factors: tuple[fx.Factor, ...], ranks: tuple[int, ...]) -> Callable:
    """fx.propose over these factors, its answers kept: completion asks every layer's
    copy of an op the same, and the factors need hashing only once per instruction."""
    @functools.lru_cache(maxsize=256)
    def answer(shardings: tuple[Optional[Sharding], ...], target: int) -> tuple[Sharding, ...]:
        return tuple(fx.propose(factors, shardings, ranks, target))
    return lambda shardings, target: answer(tuple(shardings), target)


def prune(instr: Instr, used: list[bool]) -> None:
    """Shrink `instr` to its used results where its op knows how (dead-code elimination)."""
    fn = lookup(instr.opcode).rewrites.prune
    if fn is not None:
        fn(instr, used)


def is_annotation(instr: Instr) -> bool:
    """Whether `instr` is the user's layout for its result (attrs sharding, unspecified)."""
    return lookup(instr.opcode).facets.annotation


def layouts_named(instr: Instr) -> list[Sharding]:
    """The layouts the user wrote in `instr` (annotations, manual regions' specs)."""
    fn = lookup(instr.opcode).facets.layouts_named
    return [] if fn is None else fn(instr)


def counts_exactly(dtype, n: int) -> bool:
    """Whether `dtype` holds 0, 1, ..., n - 1 exactly (no wrap, no rounding)."""
    if jax.dtypes.issubdtype(dtype, np.floating):
        return n - 1 <= 2 ** (jnp.finfo(dtype).nmant + 1)
    return np.dtype(dtype).kind in "iu" and n - 1 <= np.iinfo(dtype).max


def is_zero(v: Value) -> bool:
    """Whether `v` is all zeros by construction (a constant zero, a broadcast of one)."""
    p = v.producer
    if p is None:
        return False
    fn = lookup(p.opcode).facets.zero
    return fn is not None and fn(p, is_zero)


def splats(instr: Instr) -> bool:
    """Whether `instr`'s result repeats its one operand, a scalar, in every element."""
    fn = lookup(instr.opcode).facets.splat
    return fn is not None and fn(instr)


def partition(ctx: DeviceContext, instr: Instr, operands: list[PartitionedValue],
              targets: list[Sharding]) -> list[PartitionedValue]:
    if _computes_nothing(instr):
        return [empty(ctx, o.shape, o.dtype, t) for o, t in zip(instr.outputs, targets)]
    rule = lookup(instr.opcode).rule
    if rule.partition is not None:
        return rule.partition(ctx, instr, operands, targets)
    if rule.factors is None:
        return replicate_fallback(ctx, instr, operands, targets)
    return fx.partition(ctx, instr, rule.factors(instr), operands, targets)


def _computes_nothing(instr: Instr) -> bool:
    """Whether every result has no elements and making them is all the op does (no side
    effect, no sub-program that could have one): its operands need not move."""
    return (bool(instr.outputs) and all(0 in o.shape for o in instr.outputs) and not instr.has_side_effect
            and not any(isinstance(a, Program) for a in instr.attrs.values()))


def replicate_fallback(ctx: DeviceContext, instr: Instr, operands: list[PartitionedValue],
                       targets: list[Sharding]) -> list[PartitionedValue]:
    """Always valid: gather every operand, run the whole op on each device, slice."""
    full = [rs.reshard(ctx, o, Sharding.replicated(o.rank, ctx.num_devices)).local for o in operands]
    outs = fx.emit_same_op(ctx, instr, full, [o.shape for o in instr.outputs])
    return [rs.reshard(ctx, PartitionedValue(v, Sharding.replicated(o.rank, ctx.num_devices), o.shape), t)
            for v, o, t in zip(outs, instr.outputs, targets)]


def elementwise_flops(instr: Instr) -> int:
    """One operation per result element."""
    return sum(math.prod(o.shape) for o in instr.outputs)


def operand_flops(instr: Instr) -> int:
    """One operation per element of the first operand (reductions)."""
    return math.prod(instr.operands[0].shape)


def result_sized_bytes(instr: Instr, in_hbm: Collection[Value]) -> int:
    """Slices read as much as they write: their result's worth from the operand in HBM,
    and again to write it there, where a fusion does not keep it on chip."""
    return sum(o.nbytes * ((instr.operands[0] in in_hbm) + (o in in_hbm)) for o in instr.outputs)


def update_sized_bytes(update: int) -> Callable[[Instr, Collection[Value]], int]:
    """In-place updates write their update operand's worth into the array in HBM, first
    reading what is there where they combine with it (a scatter-add), and the update
    itself unless the fusion that made it kept it on chip (the sum of a slice of an
    accumulator and a gradient, added in place); and read the indices."""
    def nbytes(instr: Instr, in_hbm: Collection[Value]) -> int:
        u = instr.operands[update]
        combines = instr.attrs.get("reducer") is not None
        return u.nbytes * (1 + combines + (u in in_hbm)) + sum(o.nbytes for o in instr.operands[1:update])
    return nbytes


def jointly_linear(instr: Instr) -> list[tuple[int, ...]]:
    """Linear in all operands together (add, transpose, concatenate, ...)."""
    return [tuple(range(len(instr.operands)))]


def linear_in(*sets: Sequence[int]) -> Callable[[Instr], Sequence[Sequence[int]]]:
    """Linear in each of these operand sets, the others fixed (dot: (0,), (1,))."""
    return lambda instr: sets


def elementwise_factors(instr: Instr) -> list[fx.Factor]:
    """Every operand and output share every dim (scalars broadcast implicitly)."""
    out = instr.outputs[0]
    return list(_elementwise_factors(out.shape, tuple(v.rank == out.rank for v in instr.operands), len(instr.outputs)))


@functools.lru_cache(maxsize=4096)
def _elementwise_factors(shape: tuple[int, ...], full_rank: tuple[bool, ...], outputs: int) -> tuple[fx.Factor, ...]:
    # full_rank[i]: operand i has every dim of the result (else a scalar, broadcast).
    return tuple(fx.Factor(size, tuple(d if f else None for f in full_rank) + (d,) * outputs)
                 for d, size in enumerate(shape))
