"""Closed-form bounds and expectations of a training configuration for `gspmd plan
--auto` (plan_search.py): its compute, the bytes it holds, its communication, from the
model planned on one device with each rematerialization policy."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Optional, Sequence

import jax
import numpy as np

from gspmd import planning
from gspmd.spmd import cost as cm
from gspmd.spmd.cost import Hardware

if TYPE_CHECKING:
    from gspmd.plan_search import Config


class Floor:
    """Closed-form bounds of a configuration, from the model planned on one device with
    each rematerialization policy (its total compute, and what it holds beyond its
    arguments: activations and temporaries, the whole batch's) and its state's bytes."""

    def __init__(self, model: str, one: planning.Sizes, hw: Hardware, policies: Sequence[Optional[str]]):
        self.hw = hw
        # (never fitting one device, they are taken as partitioned: fitting them is time spent for nothing)
        plans = {p: planning.plan(model, dataclasses.replace(one, remat=p), hw, fit_memory=False)
                 for p in dict.fromkeys([*policies, "nothing_saveable"])}
        self.compute_s = {p: plan.report.compute_seconds for p, plan in plans.items()}
        self.transient = {p: plan.report.peak_memory_bytes - plan.report.memory.arguments_bytes
                          for p, plan in plans.items()}
        self.policies = list(policies)
        case = plans[self.policies[0]].case
        self.state_bytes = sum(_nbytes(case.args[i]) for i in case.donate)
        self.layers = case.sizes.get("layers") or 1
        weights = jax.tree_util.tree_leaves(case.args[0])
        self.weights = len(weights)          # weight tensors per layer (a stack's leaves hold every layer's)
        self.weight_bytes = _nbytes(weights) / self.layers / self.weights
        width = 2 if case.sizes.get("activation_dtype", "bfloat16") == "bfloat16" else 4
        self.activation_bytes = width * math.prod(case.sizes.get(k) or 1 for k in ("batch", "seq", "model_dim"))

    def bounds(self, c: Config) -> tuple[float, float, float, dict]:
        """(seconds, expected seconds, bytes per device, held) for `c`. No plan can hold
        less than the bytes (the state over the devices that split it, megatron's not
        over the data axis), nor take less than the seconds: the compute of the least
        recompute spread over every device (1F1B's recomputes each layer), stretched by
        the bubble. `held`: each policy's state and activations so spread (a microbatch's
        at a time under gradient accumulation, every microbatch's in a GPipe or circular
        pipeline, a stage's worth in 1F1B), what a plan of it is expected to hold -- not
        a bound: fitting a plan to memory gathers and recomputes what it holds idle.
        The expected seconds: the compute of the least recompute expected to fit."""
        n = math.prod(c.mesh)
        state = self.state_bytes / (n // c.x if c.strategy == "megatron" else n)
        m = c.microbatches or 1
        share = n * (m / c.stages if c.schedule == "1f1b" else 1 if c.pipelined else m)
        held = {p: state + self.transient[p] / share for p in self.policies}
        if c.schedule == "1f1b":
            least = expected = self.compute_s["nothing_saveable"]
        else:
            least = min(self.compute_s[p] for p in self.policies)
            fitting = [p for p in self.policies if held[p] <= self.hw.usable_bytes] or self.policies[-1:]
            expected = self.compute_s[fitting[0]]
        stretch = 1.0
        if c.pipelined:
            slots = (c.microbatches or c.stages) * (c.repeats or 1)
            stretch = (slots + c.stages - 1) / slots
        return least * stretch / n, expected * stretch / n, state, held

    def communication(self, c: Config) -> float:
        """What the strategy's collectives take, estimated with the cost model over the
        mesh's device groups: per layer and microbatch, the activations over the model
        axis (two all-reduces forward, two backward, as Megatron-LM counts them; twice as
        many with the 2d strategy) and, with the 2d strategy (weights split over the data
        axis too), each weight gathered twice there and its gradient reduce-scattered; with
        the megatron strategy, each stacked weight's gradient all-reduced over the data
        axis once a step; with a pipeline, each step's activations passed on, forward and
        backward."""
        devices = cm.device_mesh(c.mesh, self.hw)
        x, y = c.x, c.y
        m, layers = c.microbatches or 1, self.layers / (c.stages or 1)     # a stage's
        act = self.activation_bytes / (x * m)

        def seconds(pattern: cm.Pattern, nbytes: float, axes: tuple[int, ...]) -> float:
            return cm.axes_seconds(pattern, nbytes, devices, axes, self.hw)

        model, data = (c.model_axis,), (c.data_axis,)
        # Megatron-LM's four all-reduces of a layer's activations; the 2d strategy also splits
        # them over the model axis, gathering and reduce-scattering around each matmul: twice
        # as many collectives
        collectives = 4 if c.strategy == "megatron" or c.strategy is None else 8
        per_layer = collectives * seconds(cm.Pattern.ALL_REDUCE, act, model) if y > 1 else 0.0
        gradients = 0.0
        if x > 1 and c.strategy == "megatron":      # each stacked weight's, once a step, after the loops
            gradients = self.weights * seconds(cm.Pattern.ALL_REDUCE, self.weight_bytes * layers / y, data)
        elif x > 1 and c.strategy is not None:      # 2d: weights gathered over the data axis (FSDP)
            shard = self.weight_bytes / (x * y)
            per_layer += self.weights * (2 * seconds(cm.Pattern.ALL_GATHER, shard * x, data)
                                         + seconds(cm.Pattern.REDUCE_SCATTER, shard, data))
        if not c.pipelined:
            return per_layer * layers * m + gradients
        # Each stage runs its layer every step, bubbles included.
        steps = m * c.repeats + c.stages - 1
        return (per_layer * layers / c.repeats * steps + gradients
                + 2 * steps * seconds(cm.Pattern.PERMUTE, act / y, (0,)))


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
