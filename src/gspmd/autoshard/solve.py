"""Choose one option per class minimizing node costs plus pairwise edge costs.

Two solvers:
- `solve_exact`: an integer linear program (one binary per class option, one
  continuous variable per pair of options of each edge, tied to both ends' choices;
  HiGHS through scipy), exact where it finishes within its time limit;
- `solve`: dynamic programming over the program's order: classes are decided one at a
  time; two partial solutions that agree on every decided class that still has
  undecided neighbours (the frontier) have the same future, so only the cheaper one is
  kept. With no limit on how many partial solutions are kept, that is exact too; when
  the frontier grows past `beam` distinct states the cheapest `beam` are kept (a beam
  search), and a pass of single-class improvements (each class re-chosen against its
  neighbours' choices, until none improves) polishes the result. It scales where the
  program is too large for the exact solver.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

BEAM = 256


@dataclass
class Solution:
    choice: list[int]      # per class: index into its options
    cost: float
    exact: bool            # no partial solution was ever dropped for the beam


def solve(node_costs: Sequence[np.ndarray], edges: Sequence[tuple[int, int, np.ndarray]], order: Sequence[int],
          beam: int = BEAM) -> Solution:
    n = len(node_costs)
    neighbours: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for u, v, m in edges:
        neighbours[v].append((u, m))      # rows: u's options
        neighbours[u].append((v, m.T))
    position = np.empty(n, np.int64)
    position[list(order)] = np.arange(n)
    last_needed = [max([position[c]] + [position[u] for u, _ in neighbours[c]]) for c in range(n)]
    # Partial solutions keep only the choices of frontier classes (columns) and a hash
    # of them (a sum of random 64-bit numbers, one per class and choice); how each came
    # about is kept as back-pointers (parent, choice) per step.
    mix = np.random.default_rng(0).integers(0, 2 ** 63, (n, max(len(x) for x in node_costs)), dtype=np.uint64)
    front = np.zeros((1, 0), np.int32)
    keys = np.zeros(1, np.uint64)
    column: dict = {}
    costs = np.zeros(1)
    history = []
    exact = True
    for step, c in enumerate(order):
        k = len(node_costs[c])
        inc = np.broadcast_to(node_costs[c], (len(front), k)).copy()
        for u, m in neighbours[c]:
            if position[u] < step:
                inc += m[front[:, column[u]]]
        total = (costs[:, None] + inc).ravel()
        for u in [u for u in column if last_needed[u] <= step]:      # leaves the frontier (uint64 wraps)
            keys = keys - mix[u][front[:, column.pop(u)]]
        stays = last_needed[c] > step
        new_keys = (keys[:, None] + (mix[c][:k] if stays else np.zeros(k, np.uint64))).ravel()
        by_cost = np.argsort(total, kind="stable")
        _, first = np.unique(new_keys[by_cost], return_index=True)
        keep = by_cost[np.sort(first)]
        if len(keep) > beam:
            exact = False
            keep = keep[:beam]
        parents, picks = np.divmod(keep, k)
        columns = sorted(column, key=column.get)
        front = front[parents][:, [column[u] for u in columns]]
        column = {u: j for j, u in enumerate(columns)}
        if stays:
            column[c] = front.shape[1]
            front = np.concatenate([front, picks[:, None].astype(np.int32)], axis=1)
        keys, costs = new_keys[keep], total[keep]
        history.append((parents, picks))
    choice = [0] * n
    i = int(np.argmin(costs))
    for c, (parents, picks) in zip(reversed(order), reversed(history)):
        choice[c] = int(picks[i])
        i = int(parents[i])
    if not exact:
        choice = _improve(choice, node_costs, neighbours)
    return Solution(choice, total_cost(choice, node_costs, edges), exact)


def _improve(choice: list[int], node_costs, neighbours, sweeps: int = 10) -> list[int]:
    for _ in range(sweeps):
        changed = False
        for c in range(len(choice)):
            local = node_costs[c].copy()
            for u, m in neighbours[c]:
                local += m[choice[u]]
            pick = int(np.argmin(local))
            if local[pick] < local[choice[c]] - 1e-15:
                choice[c], changed = pick, True
        if not changed:
            break
    return choice


def solve_exact(node_costs: Sequence[np.ndarray], edges: Sequence[tuple[int, int, np.ndarray]],
                time_limit: float = 20.0) -> Optional[Solution]:
    """The integer program's optimum (None if HiGHS finds none in time). Its linear
    relaxation is solved first: where that is integral (as it mostly is), it is the
    optimum and the branching is skipped."""
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    sizes = np.array([len(c) for c in node_costs])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n_choice = int(offsets[-1])
    costs = [np.concatenate(node_costs)]
    rows, cols = [np.repeat(np.arange(len(sizes)), sizes)], [np.arange(n_choice)]
    values = [np.ones(n_choice)]
    row, col = len(sizes), n_choice
    for u, v, m in edges:
        ku, kv = m.shape
        pair = col + np.arange(ku * kv).reshape(ku, kv)
        costs.append(m.ravel())
        # sum over v's options of pair(a, .) == choice(u, a); sum over u's of pair(., b) == choice(v, b)
        for side, count, end in ((pair, ku, u), (pair.T, kv, v)):
            r = row + np.arange(count)
            rows += [np.repeat(r, side.shape[1]), r]
            cols += [side.ravel(), offsets[end] + np.arange(count)]
            values += [np.ones(side.size), -np.ones(count)]
            row += count
        col += ku * kv
    a = sparse.csr_array((np.concatenate(values), (np.concatenate(rows), np.concatenate(cols))), shape=(row, col))
    bounds = np.zeros(row)
    bounds[:len(sizes)] = 1
    cost = np.concatenate(costs)
    constraints = LinearConstraint(a, bounds, bounds)
    result = milp(cost, constraints=constraints, integrality=np.zeros(col), bounds=Bounds(0, 1),
                  options={"time_limit": time_limit})
    integral = result.x is not None and np.allclose(result.x[:n_choice], np.round(result.x[:n_choice]), atol=1e-6)
    if result.x is not None and not integral:
        integrality = np.zeros(col)
        integrality[:n_choice] = 1
        result = milp(cost, constraints=constraints, integrality=integrality, bounds=Bounds(0, 1),
                      options={"time_limit": time_limit})
    if result.x is None:
        return None
    picks = result.x[:n_choice]
    choice = [int(np.argmax(picks[offsets[c]:offsets[c + 1]])) for c in range(len(sizes))]
    return Solution(choice, total_cost(choice, node_costs, edges), result.status == 0)


def total_cost(choice: Sequence[int], node_costs, edges) -> float:
    return float(sum(node_costs[c][k] for c, k in enumerate(choice))
                 + sum(m[choice[u], choice[v]] for u, v, m in edges))
