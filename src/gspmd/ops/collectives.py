"""partition-id and the five collectives. Their semantics run over all devices at once
(evaluate_all); groups are rows of device ids, ordered."""
from __future__ import annotations

import numpy as np

from gspmd.ops.registry import register


def _evaluate_partition_id(instr, args, device):
    return [np.asarray(device, instr.outputs[0].dtype)]


def _per_group(instr, per_device, combine):
    """Apply combine(member arrays) -> member results for each device group."""
    out = [None] * len(per_device)
    for group in instr.attrs["groups"]:
        results = combine([per_device[d][0] for d in group])
        for d, r in zip(group, results):
            out[d] = [np.asarray(r, instr.outputs[0].dtype)]
    return out


def _all_reduce(instr, per_device):
    reducer = instr.attrs["reducer"]
    return _per_group(instr, per_device, lambda xs: [reducer.reduce(np.stack(xs), (0,))] * len(xs))


def _all_gather(instr, per_device):
    dim = instr.attrs["dim"]
    return _per_group(instr, per_device, lambda xs: [np.concatenate(xs, axis=dim)] * len(xs))


def _reduce_scatter(instr, per_device):
    reducer, dim = instr.attrs["reducer"], instr.attrs["dim"]
    return _per_group(instr, per_device, lambda xs: np.split(reducer.reduce(np.stack(xs), (0,)), len(xs), axis=dim))


def _all_to_all(instr, per_device):
    split, concat = instr.attrs["split_dim"], instr.attrs["concat_dim"]

    def exchange(xs):
        chunks = [np.split(x, len(xs), axis=split) for x in xs]
        return [np.concatenate([chunks[src][dst] for src in range(len(xs))], axis=concat)
                for dst in range(len(xs))]
    return _per_group(instr, per_device, exchange)


def _collective_permute(instr, per_device):
    # Devices that nobody sends to receive zeros (HLO semantics).
    out = [[np.zeros_like(x[0])] for x in per_device]
    for src, dst in instr.attrs["pairs"]:
        out[dst] = [per_device[src][0].copy()]
    return out


register("partition-id", evaluate=_evaluate_partition_id)
register("all-reduce", evaluate_all=_all_reduce)
register("all-gather", evaluate_all=_all_gather)
register("reduce-scatter", evaluate_all=_reduce_scatter)
register("all-to-all", evaluate_all=_all_to_all)
register("collective-permute", evaluate_all=_collective_permute)
