"""The search's view of a program: factor spaces ("nodes") joined by data edges.

Every op is a node whose choices are layouts of its factor space: its record's
`factors` (several per dim, of their kinds), or, for the few ops whose records declare
none, every dim whole. Each value belongs to the node that produces it, with a map from
its dims to the node's factors (major first); each operand says which factors its dims
need. Ops that only re-lay one operand (unary element-wise ops, converts, transposes)
join their operand's node, and values made from nothing (constants, iotas, broadcasts
of scalars) that one op reads take the layout that op needs, for free.

Nodes that look alike for `ROUNDS` steps around them (the same layer, repeated) are
tied into one class, which the search decides once: the solution is the same in every
layer, as hand-written strategies are, and its cost is still exact (each class's cost
is the sum over its members).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from gspmd import ops
from gspmd.ir import Instr, Program, Value
from gspmd.spmd.factors import PASS, PERMUTE, REDUCE, REPLICATE, Factor, FactorKind, split_over

DimMap = tuple   # per dim of a value: the node's factors that occupy it, major first
ROUNDS = 3       # how far around a node tying looks
CARRY = -1       # an Edge's operand_index for state carried to the next step


@dataclass(eq=False)
class Node:
    index: int
    sizes: tuple[int, ...]                  # factor sizes
    kinds: tuple[FactorKind, ...]
    position: int                           # program order (parameters first)
    instr: Optional[Instr] = None           # the op; None for a parameter
    values: list = field(default_factory=list)     # [(Value, DimMap)] laid out by this node
    operands: list = field(default_factory=list)   # [(Value, DimMap)] the op reads, as it needs them
    flops: int = 0
    annotation: Optional[Instr] = None      # a user's annotation: its layout is fixed
    signature: tuple = ()                   # what tying compares first
    runs: tuple = ()                        # factors that share one dim of a tensor, major first

    def splittable(self, f: int) -> bool:
        return self.kinds[f] is not REPLICATE and self.sizes[f] > 1

    def reduces(self, f: int) -> bool:
        return self.kinds[f] is REDUCE

    def contiguous(self, tiles: Sequence[int]) -> bool:
        """Whether splitting the factors `tiles` ways leaves every tensor's shards
        contiguous: in a dim of several factors, a minor factor is split only where
        the major ones are split whole (reshape [16] -> [2, 8]: splitting the 8 alone
        is no split of the 16)."""
        return all(split_over([self.sizes[f] for f in run], math.prod(tiles[f] for f in run)) ==
                   [tiles[f] for f in run] for run in self.runs)


@dataclass
class Edge:
    """Value `value_index` of class `source` is operand `operand_index` of class `target`,
    `count` times over (once per tied member). operand_index CARRY: the value is a
    result that the next step reads as the target parameter (updated state), so it
    should leave in the parameter's layout."""
    source: int
    value_index: int
    target: int
    operand_index: int
    count: int


@dataclass
class Graph:
    program: Program
    nodes: list[Node]
    node_of: dict                 # Value -> (Node, DimMap)
    free: dict                    # Value made from nothing -> (reading Node, operand index)
    classes: list[list[Node]]     # tied nodes; the first is the representative
    class_of: list[int]           # node index -> class
    edges: list[Edge]             # between classes (self-edges included)

    def representative(self, c: int) -> Node:
        return self.classes[c][0]


def build(program: Program, marks: Optional[dict] = None, carries: Sequence[tuple[Value, Value]] = (),
          rounds: int = ROUNDS) -> Graph:
    """`marks`: values whose nodes must not be tied with others unless marked alike
    (parameters whose layout the user fixed). `carries`: (result, parameter) pairs of
    state the function updates."""
    builder = _Builder(program)
    for v, mark in (marks or {}).items():
        builder.node_of[v][0].signature += (mark,)
    graph = Graph(program, builder.nodes, builder.node_of, {}, [], [], [])
    _free_sources(graph)
    _tie(graph, rounds)
    _carry(graph, carries)
    return graph


class _Builder:
    def __init__(self, program: Program):
        self.nodes: list[Node] = []
        self.node_of: dict = {}
        for p in program.params:
            self._new(tuple(p.shape), (PASS,) * p.rank, None, [(p, tuple((d,) for d in range(p.rank)))], [],
                      ("param",))
        for instr in program.instrs:
            self._add(instr)

    def _new(self, sizes, kinds, instr, values, operands, signature, flops=0, annotation=None) -> Node:
        runs = tuple(sorted({fs for _, dimmap in values + operands for fs in dimmap if len(fs) > 1}))
        node = Node(len(self.nodes), tuple(sizes), tuple(kinds), len(self.nodes), instr, list(values),
                    list(operands), flops, annotation, signature, runs)
        self.nodes.append(node)
        for v, dimmap in values:
            self.node_of[v] = (node, dimmap)
        return node

    def _add(self, instr: Instr) -> None:
        factors = factors_of(instr)
        n_in = len(instr.operands)
        follows = self._follows(instr, factors)
        if follows is not None:
            node, dimmap = follows
            node.values.append((instr.output, dimmap))
            node.signature += (instr.opcode,)
            self.node_of[instr.output] = (node, dimmap)
            return
        dimmaps = [_dims_to_factors(factors, t, v.rank) for t, v in enumerate(instr.operands + instr.outputs)]
        flops = ops.flops(instr)
        self._new([f.size for f in factors], [f.kind for f in factors], instr,
                  list(zip(instr.outputs, dimmaps[n_in:])), list(zip(instr.operands, dimmaps[:n_in])),
                  (instr.opcode,), flops, instr if ops.is_annotation(instr) else None)

    def _follows(self, instr: Instr, factors: list[Factor]) -> Optional[tuple[Node, DimMap]]:
        """(operand's node, output dim map) when `instr` only re-lays its one operand."""
        shaped = [t for t, v in enumerate(instr.operands) if v.rank > 0]
        if (len(instr.outputs) != 1 or len(shaped) != 1 or ops.is_annotation(instr)
                or ops.lookup(instr.opcode).timing.flops is not None or instr.operands[shaped[0]] not in self.node_of):
            return None
        t, out = shaped[0], instr.output
        x = instr.operands[t]
        pairs = [(f.dims[t], f.dims[len(instr.operands)]) for f in factors]
        if (any(f.kind is not PASS for f in factors) or any(None in p for p in pairs)
                or sorted(p[0] for p in pairs) != list(range(x.rank))
                or sorted(p[1] for p in pairs) != list(range(out.rank))):
            return None
        node, dimmap = self.node_of[x]
        out_map = [None] * out.rank
        for d, e in pairs:
            out_map[e] = dimmap[d]
        return node, tuple(out_map)


def factors_of(instr: Instr) -> list[Factor]:
    """The op record's factors, a permutation factor priced as pass-through (as
    propagation carries it); every dim whole where the record declares none (constants,
    iotas, callbacks, conditionals, manual regions)."""
    declared = ops.lookup(instr.opcode).rule.factors
    if declared is None:
        return [Factor(n, _one_dim(len(instr.operands) + len(instr.outputs), t, d), REPLICATE)
                for t, v in enumerate(instr.operands + instr.outputs) for d, n in enumerate(v.shape)]
    return [replace(f, kind=PASS) if f.kind is PERMUTE else f for f in declared(instr)]


def _one_dim(count: int, t: int, d: int) -> tuple:
    dims: list = [None] * count
    dims[t] = d
    return tuple(dims)


def _dims_to_factors(factors: list[Factor], t: int, rank: int) -> DimMap:
    dimmap: list = [()] * rank
    for f, fac in enumerate(factors):
        if fac.dims[t] is not None:
            dimmap[fac.dims[t]] += (f,)
    return tuple(dimmap)


def consumers(graph: Graph) -> dict:
    """Node -> [(reading node, operand index)] for each of its values' readers."""
    readers: dict = defaultdict(list)
    for node in graph.nodes:
        for i, (v, _) in enumerate(node.operands):
            if v.rank > 0 and v in graph.node_of:
                readers[graph.node_of[v][0]].append((node, i))
    return readers


def _free_sources(graph: Graph) -> None:
    """Values made from nothing and read once take their reader's layout: drop their nodes."""
    readers = consumers(graph)
    kept = []
    for node in graph.nodes:
        reads = [v for v, _ in node.operands if v.rank > 0]
        if node.instr is not None and not reads and node.annotation is None and len(readers[node]) == 1:
            reader = readers[node][0]
            for v, _ in node.values:
                graph.free[v] = reader
                del graph.node_of[v]
            continue
        kept.append(node)
    for i, node in enumerate(kept):
        node.index = i
    graph.nodes[:] = kept


def _tie(graph: Graph, rounds: int) -> None:
    """Weisfeiler-Lehman colours: a node's colour is its signature, refined `rounds`
    times with its producers' and readers' colours. Equal colour, one class."""
    nodes = graph.nodes
    def producer(v):
        node = graph.node_of[v][0]
        return node.index, value_index(node, v)

    producers = [[producer(v) if v in graph.node_of else None for v, _ in n.operands] for n in nodes]
    readers = [[] for _ in nodes]
    for n in nodes:
        for i, p in enumerate(producers[n.index]):
            if p is not None:
                readers[p[0]].append((n.index, i, p[1]))
    colour = [hash(_initial_signature(n)) for n in nodes]
    for _ in range(rounds):
        colour = [hash((colour[i],
                        tuple(None if p is None else (colour[p[0]], p[1]) for p in producers[i]),
                        tuple(sorted((colour[r], k, j) for r, k, j in readers[i]))))
                  for i in range(len(nodes))]
    by_colour: dict = {}
    graph.class_of = [by_colour.setdefault(c, len(by_colour)) for c in colour]
    graph.classes = [[] for _ in by_colour]
    for n in nodes:
        graph.classes[graph.class_of[n.index]].append(n)
    counts: dict = defaultdict(int)
    for n in nodes:
        for i, p in enumerate(producers[n.index]):
            if p is not None:
                counts[(graph.class_of[p[0]], p[1], graph.class_of[n.index], i)] += 1
    graph.edges = [Edge(cu, vi, cv, oi, count) for (cu, vi, cv, oi), count in counts.items()]


def _carry(graph: Graph, carries: Sequence[tuple[Value, Value]]) -> None:
    counts: dict = defaultdict(int)
    for result, param in carries:
        if result.rank and result in graph.node_of and param in graph.node_of:
            source, target = graph.node_of[result][0], graph.node_of[param][0]
            counts[(graph.class_of[source.index], value_index(source, result), graph.class_of[target.index])] += 1
    graph.edges += [Edge(cu, vi, cv, CARRY, count) for (cu, vi, cv), count in counts.items()]


def value_index(node: Node, v: Value) -> int:
    """Where v is among the values `node` lays out."""
    return next(i for i, (w, _) in enumerate(node.values) if w is v)


def _initial_signature(n: Node) -> tuple:
    ann = None
    if n.annotation is not None:
        ann = (n.annotation.attrs["sharding"], tuple(n.annotation.attrs["unspecified"]))
    return (n.signature, n.sizes, tuple(k.value for k in n.kinds), n.flops, ann,
            tuple((v.shape, v.dtype.str, m) for v, m in n.values),
            tuple((v.shape, v.dtype.str, m) for v, m in n.operands))
