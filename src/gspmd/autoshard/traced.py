"""The function gspmd.auto plans, traced once: its program, and which values each
call in its source computes (where an intermediate annotation goes)."""
from __future__ import annotations

from typing import Callable, Optional

import jax

from gspmd.autoshard import plan as plans
from gspmd.frontend import trace
from gspmd.ir.dce import eliminate_dead_code
from gspmd.mesh import Mesh
from gspmd.passes.cse import eliminate_common_subexpressions


class Traced:
    """fn traced once: its program, and where each call in its source went (to annotate
    intermediate values where the source computes them)."""

    def __init__(self, fn: Callable, args: tuple, mesh: Optional[Mesh]):
        self.fn, self.args = fn, args
        flat, tree = jax.tree_util.tree_flatten(args)
        equations: list = []     # per equation of fn's jaxpr: (equation, operand values, result values)
        self.program, self.out_tree = trace(lambda *a: fn(*jax.tree_util.tree_unflatten(tree, a)), flat,
                                            getattr(fn, "__name__", "main"), mesh,
                                            on_equation=lambda i, eqn, ins, outs: equations.append((eqn, ins, outs)))
        eliminate_dead_code(self.program)
        # The partitioner merges repeated instructions (a broadcast the gradient repeats)
        # after partitioning, which keeps the first alive longer; so does the search.
        eliminate_common_subexpressions(self.program)
        self.results: dict = {}      # source location -> the values its call computes, each run
        self.gradients: dict = {}    # source location -> those values' cotangents as read
        self.what: dict = {}
        for where, site in plans.call_sites([eqn for eqn, _, _ in equations]).items():
            self.results[where] = [equations[i][2][j] for i, j in site.results]
            self.gradients[where] = [equations[i][1][j] for i, j in site.gradients]
            eqn, _, outs = equations[site.results[0][0]]
            self.what[where] = f"{eqn.primitive.name} {outs[site.results[0][1]].type_str()}"
        self.location = {v: where for where, values in self.results.items() for v in values}
        self.position = {instr: i for i, instr in enumerate(self.program.instrs)}

    def carried_state(self) -> list[tuple]:
        """(result, parameter) pairs of state fn updates: a result (or an element of a
        tuple of results) shaped exactly like one of its arguments (new parameters,
        optimizer state) is that argument's next value."""
        outs = jax.tree_util.tree_unflatten(self.out_tree, self.program.outputs)
        parts = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        ins = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.args), self.program.params)
        free = list(ins)
        pairs = []
        for part in parts:
            for arg in free:
                if _same_shapes(part, arg):
                    pairs += list(zip(jax.tree_util.tree_leaves(part), jax.tree_util.tree_leaves(arg)))
                    free.remove(arg)
                    break
        return pairs

    def intermediate(self, where: str, layouts: dict, mesh: Mesh) -> Optional[plans.Intermediate]:
        """The annotation at `where`, if the strategy lays out every value the call
        there computes alike (one line of code annotates them all)."""
        found = {layouts.get(v) for v in self.results[where]}
        if len(found) != 1 or None in found:
            return None
        return plans.Intermediate(where, self.what[where], plans.dims_mapping(found.pop(), mesh),
                                  len(self.results[where]))


def _same_shapes(a, b) -> bool:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    return tree_a == tree_b and bool(leaves_a) and all(
        (x.shape, x.dtype) == (y.shape, y.dtype) for x, y in zip(leaves_a, leaves_b))
