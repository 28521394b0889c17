"""Per-op knowledge, one module per op family, all registered in ops.registry.OPS."""
# Importing each op family registers its opcodes.
from gspmd.ops import (callbacks, collectives, control, conv, dot, elementwise, gather_scatter, kernels,  # noqa: F401
                       linalg, manual, random, reduce, shape, slicing, sort, window)
from gspmd.ops.elementwise import annotated
from gspmd.ops.registry import (KEY_PRIMITIVES, OPS, PRIMITIVES, OpDef, collective_bytes, flops, informants,
                                is_annotation, is_zero, layouts_named, lookup, lowered_collectives, lowering_steps,
                                partition, propagate, proposer, prune, runs, seeds, splats, storage, tensors,
                                wants_row_major)

__all__ = ["KEY_PRIMITIVES", "OPS", "PRIMITIVES", "OpDef", "annotated", "collective_bytes", "flops", "informants",
           "is_annotation", "is_zero", "layouts_named", "lookup", "lowered_collectives", "lowering_steps", "partition",
           "propagate", "proposer", "prune", "runs", "seeds", "splats", "storage", "tensors",
           "wants_row_major"]
