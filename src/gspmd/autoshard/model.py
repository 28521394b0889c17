"""A candidate strategy and what it costs, as the search sees it.

An assignment gives each class of tied nodes (graph.py), for every mesh axis, the
factor that axis splits: an `Option` (f, g). f is the factor (NONE: the axis splits
nothing here); a reduce factor's partial results are combined by an all-reduce, or
(g >= 0) by a reduce-scatter that leaves the axis splitting the result dim of factor g.
Layouts, costs and peak memory follow from the assignment; `axis_problem` prices
every choice for one axis with the others held, which is what the solver decides.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from gspmd.analysis.memory import run_order
from gspmd.autoshard.costs import Layout, Pricing
from gspmd.autoshard.graph import CARRY, DimMap, Graph, Node, value_index
from gspmd.mesh import Mesh
from gspmd.sharding import Sharding
from gspmd.spmd.cost import Pattern

NONE = -1
# What the solver charges for any change of layout along an edge, even a free slice:
# among equally fast strategies it prefers those whose values keep their layout, which
# is what sharding completion does with the annotations that express the strategy.
CHANGE = 1e-9
# And what it charges per byte of an argument held on a device: among equally fast
# strategies, it prefers those that need less memory (splitting a batch it could keep).
SMALLER = 1e-18
Option = tuple            # (factor, reduce-scatter target factor or NONE)
UNUSED: Option = (NONE, NONE)
Assignment = list         # per class: a tuple of Options, one per mesh axis


@dataclass(eq=False)
class Copy:
    """A value resharded from layout `made` to `needed` for the ops that read it so, at
    steps `reads` along class edges `edges` (one per read). It is made once (a copy
    serves all of them) but held only where read: under a memory limit the partitioner
    reshards again near later readers rather than hold a copy across the peak."""
    value: object
    made: Layout
    needed: Layout
    reads: list
    edges: list


@dataclass
class Estimate:
    """The search's estimate of a whole strategy (one step, per device)."""
    exposed: float                  # the share of communication compute does not hide
    compute_seconds: float = 0.0
    collectives: Counter = field(default_factory=Counter)   # (Pattern, axes, bytes) -> how many
    communication_seconds: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exposed * self.communication_seconds

    def by_kind(self) -> dict[Pattern, tuple]:
        """Pattern -> (count, bytes per device), in the order of the kinds' names"""
        out: dict = {}
        for (pattern, _, nbytes), n in self.collectives.items():
            count, total = out.get(pattern, (0, 0))
            out[pattern] = (count + n, total + n * nbytes)
        return dict(sorted(out.items(), key=lambda item: item[0].value))


@dataclass
class Tally:
    """What one search has done: the strategies it solved (one descent over the mesh
    axes each), over all the models it priced."""
    strategies: int = 0


class Model:
    """One graph priced on one mesh: layouts, per-axis problems, whole estimates.
    `tally`: the search's count, shared by the models of one search."""

    def __init__(self, graph: Graph, mesh: Mesh, pricing: Pricing, allowed: Optional[dict] = None,
                 tally: Optional[Tally] = None):
        self.graph, self.mesh, self.pricing = graph, mesh, pricing
        self.tally = tally or Tally()
        self.axes = range(mesh.ndim)
        self.axis_sizes = mesh.shape
        # the axes the search decides: size-1 axes split nothing and stay unused (MaxText's
        # meshes have a dozen of them)
        self.splitting = [a for a in self.axes if self.axis_sizes[a] > 1]
        # class -> per axis: the Options a user's annotation (or fixed=) leaves open
        self.allowed = dict(allowed or {})
        self.expressible = True   # False: an annotation in the function cannot be said on this mesh
        for c, members in enumerate(graph.classes):
            ann = members[0].annotation
            if ann is not None:
                found = annotation_options(ann.attrs["sharding"], ann.attrs["unspecified"], mesh)
                self.expressible &= found is not None
                self.allowed[c] = found
        self._live = _Liveness(graph)
        self._layouts: dict = {}
        self._tables: dict = {}   # reshard costs between lists of layouts

    # -- layouts --------------------------------------------------------------------
    def layout(self, options: tuple, dimmap: DimMap, output: bool) -> Layout:
        """The layout of a tensor whose dims occupy `dimmap`'s factors of a node laid
        out by `options` (an output: reduce-scattered axes included)."""
        key = (options, dimmap, output)
        cached = self._layouts.get(key)
        if cached is None:
            axes_of: dict = {}
            for a, (f, g) in enumerate(options):
                if f != NONE:
                    axes_of.setdefault(f, []).append(a)
                if output and g != NONE:
                    axes_of.setdefault(g, []).append(a)
            cached = self._layouts[key] = tuple(tuple(a for f in fs for a in axes_of.get(f, ())) for fs in dimmap)
        return cached

    def axis_layouts(self, held: tuple, axis: int, choices: Sequence[Option], dimmap: DimMap,
                     output: bool) -> list[Layout]:
        """The layouts under each choice for `axis` (the others as `held`): the held
        layout with the axis added where the chosen factor sits."""
        base = self.layout(held, dimmap, output)
        found = []
        for f, g in choices:
            dims = [d for d, fs in enumerate(dimmap) if f != NONE and (f in fs or (output and g in fs))]
            if not dims:
                found.append(base)
                continue
            layout = list(base)
            for d in dims:
                layout[d] = tuple(sorted(base[d] + (axis,)))
            found.append(tuple(layout))
        return found

    def tiles(self, node: Node, options: tuple, output: bool = False) -> list[int]:
        tiles = [1] * len(node.sizes)
        for a, (f, g) in enumerate(options):
            if f != NONE:
                tiles[f] *= self.axis_sizes[a]
            if output and g != NONE:
                tiles[g] *= self.axis_sizes[a]
        return tiles

    def options(self, c: int, current: tuple, axis: int) -> list[Option]:
        """The choices for `axis` in class c with its other axes as in `current`."""
        node = self.graph.representative(c)
        held = current[:axis] + (UNUSED,) + current[axis + 1:]
        tiles, out_tiles = self.tiles(node, held), self.tiles(node, held, output=True)
        k = self.axis_sizes[axis]
        outs = self._output_factors(node)
        found = [UNUSED]
        for f in range(len(node.sizes)):
            if not node.splittable(f) or node.sizes[f] % (tiles[f] * k) or not node.contiguous(_times(tiles, f, k)):
                continue
            found.append((f, NONE))
            if node.reduces(f):
                found += [(f, g) for g in outs if node.sizes[g] % (out_tiles[g] * k) == 0
                          and node.contiguous(_times(_times(out_tiles, f, k), g, k))]
        if c in self.allowed:
            found = [o for o in found if o in self.allowed[c][axis]]
        return found

    @staticmethod
    def _output_factors(node: Node) -> list[int]:
        if node.instr is None:
            return []
        own = node.values[:len(node.instr.outputs)]
        return sorted({f for _, m in own for fs in m for f in fs if node.splittable(f)})

    # -- costs ------------------------------------------------------------------------
    def node_collectives(self, node: Node, options: tuple) -> list:
        """Combining partial results of split reduce factors."""
        if node.instr is None:
            return []
        reduce_axes = [(a, g) for a, (f, g) in enumerate(options) if f != NONE and node.reduces(f)]
        if not reduce_axes:
            return []
        scattered = tuple(a for a, g in reduce_axes if g != NONE)
        summed = tuple(a for a, g in reduce_axes if g == NONE)
        found = []
        for v, dimmap in node.values[:len(node.instr.outputs)]:
            nbytes = self.pricing.local_bytes(self.layout(options, dimmap, True), v.shape, v.dtype.itemsize)
            if scattered:
                found.append((Pattern.REDUCE_SCATTER, scattered, nbytes))
            if summed:
                found.append((Pattern.ALL_REDUCE, summed, nbytes))
        return found

    def compute_seconds(self, node: Node, options: tuple) -> float:
        """A matmul's share of the work at the hardware's matmul roofline; a memory-bound
        op's stored results (fused ones never reach memory) through HBM."""
        if node.flops:
            operands = sum(self.pricing.local_bytes(self.layout(options, m, False), v.shape, v.dtype.itemsize)
                           for v, m in node.operands)
            return self.pricing.matmul_seconds(node.flops / math.prod(self.tiles(node, options)), operands)
        stored = sum(self.pricing.local_bytes(self.layout(options, m, True), v.shape, v.dtype.itemsize)
                     for v, m in node.values if v.producer is not None and v not in self._live.fused)
        return self.pricing.memory_seconds(stored)

    def node_seconds(self, node: Node, options: tuple) -> float:
        return self.compute_seconds(node, options) + \
            self.pricing.exposed * self.pricing.seconds(self.node_collectives(node, options))

    def class_bytes(self, c: int, options: tuple, weights: np.ndarray) -> float:
        """Bytes per device of class c's values, each weighted (how many members hold it at the peak)."""
        node = self.graph.representative(c)
        return sum(w * self.pricing.local_bytes(self.layout(options, m, True), v.shape, v.dtype.itemsize)
                   for (v, m), w in zip(node.values, weights) if w)

    # -- one axis ----------------------------------------------------------------------
    def axis_problem(self, assignment: Assignment, axis: int, memory_price: float, weights: tuple):
        """For each class its options for `axis` and their costs (the others held); for
        each pair of classes joined by values, the cost of every pair of options.
        Memory at the peak (`weights`: what weights() found live there) costs
        `memory_price` seconds per byte."""
        value_weights, copy_weights, shares = weights
        arguments = [np.full(len(members[0].values), len(members)) for members in self.graph.classes]
        options, choices, held, node_costs = [], [], [], []
        for c, members in enumerate(self.graph.classes):
            node = members[0]
            held.append(_with(assignment[c], axis, UNUSED))
            choices.append(self.options(c, assignment[c], axis))
            full = [_with(assignment[c], axis, o) for o in choices[c]]
            costs = np.array([len(members) * self.node_seconds(node, f)
                              + (memory_price * self.class_bytes(c, f, value_weights[c]) if memory_price else 0.0)
                              + (SMALLER * self.class_bytes(c, f, arguments[c]) if node.instr is None else 0.0)
                              for f in full])
            options.append(full)
            node_costs.append(costs)
        pairs: dict = {}
        for index, e in enumerate(self.graph.edges):
            u, v = self.graph.representative(e.source), self.graph.representative(e.target)
            value, out_map = u.values[e.value_index]
            made = self.axis_layouts(held[e.source], axis, choices[e.source], out_map, True)
            if e.operand_index == CARRY:
                needed = self.axis_layouts(held[e.target], axis, choices[e.target], v.values[0][1], True)
            else:
                needed = self.axis_layouts(held[e.target], axis, choices[e.target],
                                           v.operands[e.operand_index][1], False)
            (made_ids, made_layouts), (needed_ids, needed_layouts) = _factorize(made), _factorize(needed)
            key = (value.shape, value.dtype.itemsize, tuple(made_layouts), tuple(needed_layouts))
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = np.array(
                    [[self.pricing.reshard_seconds(a, b, value.shape, value.dtype.itemsize) + (a != b) * CHANGE
                      for b in needed_layouts] for a in made_layouts])
            table = e.count * shares.get(index, 1.0) * self.pricing.exposed * table
            copies = copy_weights.get(index, 0)
            if copies and memory_price:     # the resharded copies live at the peak
                table = table + memory_price * copies * np.array(
                    [[self.pricing.local_bytes(b, value.shape, value.dtype.itemsize) * (a != b)
                      for b in needed_layouts] for a in made_layouts])
            if e.source == e.target:
                node_costs[e.source] += table[made_ids, needed_ids]
                continue
            m = table[np.ix_(made_ids, needed_ids)]
            key = (e.source, e.target)
            pairs[key] = pairs[key] + m if key in pairs else m
        return options, node_costs, [(u, v, m) for (u, v), m in pairs.items()]

    # -- a whole strategy -----------------------------------------------------------------
    def estimate(self, assignment: Assignment) -> Estimate:
        """Compute, combining partial results, and resharding: each value once per
        layout it is needed in, however many ops read it so (the partitioner reshards
        once). State carried to the next step is not resharded within the step."""
        est = Estimate(self.pricing.exposed)
        for c, members in enumerate(self.graph.classes):
            node, n = members[0], len(members)
            est.compute_seconds += n * self.compute_seconds(node, assignment[c])
            for col in self.node_collectives(node, assignment[c]):
                est.collectives[col] += n
        for copy in self.copies(assignment):
            for col in self.pricing.reshard(copy.made, copy.needed, copy.value.shape, copy.value.dtype.itemsize):
                est.collectives[col] += 1
        est.communication_seconds = sum(n * self.pricing.seconds([col]) for col, n in est.collectives.items())
        est.peak_memory_bytes = self.peak(assignment)[0]
        return est

    def value_layouts(self, assignment: Assignment) -> dict:
        """Every value's layout (values read by one op only take that op's)."""
        out = {}
        for v, (node, dimmap) in self.graph.node_of.items():
            out[v] = self.layout(assignment[self.graph.class_of[node.index]], dimmap, True)
        for v, (reader, i) in self.graph.free.items():
            _, dimmap = reader.operands[i]
            if reader.operands[i][0].shape == v.shape:
                out[v] = self.layout(assignment[self.graph.class_of[reader.index]], dimmap, False)
        return out

    def peak(self, assignment: Assignment) -> tuple[int, int]:
        """Peak bytes per device, and when (a position in the program)."""
        return self._live.peak(*self._intervals(assignment)[:3])

    def _intervals(self, assignment: Assignment):
        """(births, deaths, bytes) of every value and resharded copy; the copies."""
        live = self._live
        slot_bytes = np.array([self.pricing.local_bytes(self.layout(assignment[c], m, output), v.shape,
                                                        v.dtype.itemsize)
                               for c, v, m, output in live.slots] + [0.0])
        sizes = np.where(live.slot_of >= 0, slot_bytes[live.slot_of], live.whole)
        copies = self.copies(assignment)
        held = np.array([r for c in copies for r in c.reads], np.int64)
        total = np.concatenate([sizes, np.array([self.pricing.local_bytes(c.needed, c.value.shape,
                                                                          c.value.dtype.itemsize)
                                                 for c in copies for _ in c.reads], np.float64)])
        return np.concatenate([live.births, held]), np.concatenate([live.deaths, held]), total, copies

    def copies(self, assignment: Assignment) -> list:
        """The resharded copies the strategy makes: one per value and layout some op
        reads it in other than the one it is made in. A value fusion computes inside its
        readers (a broadcast) is sliced there too: slicing it makes no copy."""
        layouts = []
        for e in self.graph.edges:
            u, v = self.graph.representative(e.source), self.graph.representative(e.target)
            made = self.layout(assignment[e.source], u.values[e.value_index][1], True)
            needed = None if e.operand_index == CARRY else \
                self.layout(assignment[e.target], v.operands[e.operand_index][1], False)
            layouts.append((made, needed))
        found: dict = {}
        for value, reader, e in self._live.reads:
            made, needed = layouts[e]
            if needed is None or needed == made or (value in self._live.fused and not self.pricing.reshard(
                    made, needed, value.shape, value.dtype.itemsize)):
                continue
            copy = found.get((value, needed))
            if copy is None:
                found[(value, needed)] = Copy(value, made, needed, [reader], [e])
            else:
                copy.reads.append(reader)
                copy.edges.append(e)
        return list(found.values())

    def sharing(self, assignment: Assignment) -> dict:
        """Per class edge, the average share of a resharded copy each of its reads pays
        (1/k when k reads use one copy): the solver prices an edge's reshard at that.
        Where the strategy reshards nothing along an edge, as if all of the value's
        readers shared one copy (the estimate counts what they really share)."""
        total: dict = {}
        for copy in self.copies(assignment):
            for e in copy.edges:
                share, n = total.get(e, (0.0, 0))
                total[e] = (share + 1 / len(copy.edges), n + 1)
        return {**self._live.fanout, **{e: share / n for e, (share, n) in total.items()}}

    def weights(self, assignment: Assignment, times: Sequence[int]) -> tuple[list, dict, dict]:
        """What axis_problem needs from the current strategy: per class, per value, how
        many of its members' values are live at `times` (the peaks seen so far; on
        average over them), and per class edge how many of its resharded copies are;
        per class edge the share of a copy its reads pay."""
        weights = [np.zeros(len(members[0].values)) for members in self.graph.classes]
        copies: dict = {}
        live = self._live
        for t in times:
            alive = (live.births <= t) & (live.deaths >= t)
            counts = np.bincount(live.slot_of[alive & (live.slot_of >= 0)], minlength=len(live.slots))
            for (c, i), n in zip(live.slot_index, counts):
                if i is not None:
                    weights[c][i] += n / len(times)
            for copy in self.copies(assignment):
                for e in {e for r, e in zip(copy.reads, copy.edges) if r == t}:
                    copies[e] = copies.get(e, 0) + 1 / len(times)
        return weights, copies, self.sharing(assignment)


def _factorize(items: list) -> tuple[np.ndarray, list]:
    """(index of each item among the distinct ones, the distinct ones)"""
    seen: dict = {}
    ids = np.array([seen.setdefault(x, len(seen)) for x in items])
    return ids, list(seen)


def _times(tiles: list[int], f: int, k: int) -> list[int]:
    return tiles[:f] + [tiles[f] * k] + tiles[f + 1:]


def _with(options: tuple, axis: int, option: Option) -> tuple:
    return options[:axis] + (option,) + options[axis + 1:]


class _Liveness:
    """When each stored top-level value is made and last read, in the order XLA runs
    the program (values loop fusion computes inside their readers are stored nowhere),
    as the report's memory model counts them; and where each value's layout comes
    from: a slot (class, value or operand of its representative), shared by the
    class's members."""

    def __init__(self, graph: Graph):
        program = graph.program
        made, last_read, self.fused = run_order(program)
        fused = self.fused
        self.step = self._steps(program, made)
        end = max(made.values(), default=0) + 1
        results = set(program.outputs)
        self.values = list(program.params) + [v for instr in program.instrs for v in instr.outputs
                                              if v not in fused]
        # Arguments and results have allocations of their own, held throughout.
        self.births = np.array([0 if v.producer is None or v in results else made.get(v, 0) for v in self.values])
        self.deaths = np.array([end if v.producer is None or v in results else
                                max(last_read.get(v, made.get(v, end)), made.get(v, 0)) for v in self.values])
        self.end = end
        self.whole = np.array([v.nbytes for v in self.values], np.float64)
        self.slots: list = []          # (class, value, dim map, as an output?)
        self.slot_index: list = []     # (class, value index in the representative, or None)
        ids: dict = {}
        for node in graph.nodes:
            c = graph.class_of[node.index]
            rep = graph.classes[c][0]
            for i, (v, _) in enumerate(node.values):
                ids[v] = self._slot(ids, (c, "value", i), (c, *rep.values[i], True), (c, i))
        for v, (reader, j) in graph.free.items():
            c = graph.class_of[reader.index]
            rep = graph.classes[c][0]
            if rep.operands[j][0].shape == v.shape:
                ids[v] = self._slot(ids, (c, "operand", j), (c, v, rep.operands[j][1], False), (c, None))
        self.slot_of = np.array([ids.get(v, -1) for v in self.values], np.int64)
        self.reads = self._reads(graph)
        readers: dict = {}
        for value, _, _ in self.reads:
            readers[value] = readers.get(value, 0) + 1
        shares: dict = {}
        for value, _, e in self.reads:
            total, n = shares.get(e, (0.0, 0))
            shares[e] = (total + 1 / readers[value], n + 1)
        self.fanout = {e: total / n for e, (total, n) in shares.items()}   # class edge -> 1/readers, on average

    @staticmethod
    def _steps(program, made: dict) -> dict:
        """The step at which each instruction runs (a fused one: where its reader runs)."""
        users = program.users()
        step: dict = {}
        for instr in reversed(program.instrs):
            stored = [made[o] for o in instr.outputs if o in made]
            readers = [step[u] for o in instr.outputs for u in users.get(o, []) if u in step]
            step[instr] = min(stored or readers or [0])
        return step

    def _reads(self, graph: Graph) -> list:
        """(value, step of the reading instruction, class edge) for every read along an edge."""
        edge_of = {(e.source, e.value_index, e.target, e.operand_index): k for k, e in enumerate(graph.edges)}
        reads = []
        for node in graph.nodes:
            if node.instr is None:
                continue
            for j, (v, _) in enumerate(node.operands):
                if v.rank and v in graph.node_of:
                    producer = graph.node_of[v][0]
                    k = edge_of.get((graph.class_of[producer.index], value_index(producer, v),
                                     graph.class_of[node.index], j))
                    if k is not None:
                        reads.append((v, self.step[node.instr], k))
        return reads

    def _slot(self, ids: dict, key, slot, index) -> int:
        if key not in ids:
            ids[key] = len(self.slots)
            self.slots.append(slot)
            self.slot_index.append(index)
        return ids[key]

    def peak(self, births: np.ndarray, deaths: np.ndarray, sizes: np.ndarray) -> tuple[int, int]:
        """The most bytes live at once, and when."""
        diff = np.zeros(self.end + 2)
        np.add.at(diff, births, sizes)
        np.add.at(diff, deaths + 1, -sizes)
        live = np.cumsum(diff)
        t = int(np.argmax(live))
        return int(live[t]), t


def annotation_options(sharding: Sharding, unspecified: Sequence[int], mesh: Mesh) -> Optional[list]:
    """Per mesh axis, the Options (over the annotated value's dims as factors) that give
    the annotated layout; dims left UNSPECIFIED may take any axis the others leave."""
    layout = sharding.mesh_axes(mesh)
    if layout is None:
        return None
    fixed = {a: d for d, axes in enumerate(layout) for a in axes}
    open_dims = [d for d in unspecified if not layout[d]]
    return [{(fixed[a], NONE)} if a in fixed else {UNUSED, *((d, NONE) for d in open_dims)}
            for a in range(mesh.ndim)]

