"""Per-op knowledge, one module per op family, all registered in ops.registry.OPS."""
from gspmd.ops import collectives, control, conv, dot, elementwise, gather_scatter, reduce, shape, slicing, window  # noqa: F401  (registers)
from gspmd.ops.registry import OPS, OpDef, lookup, partition, propagate, tensors

__all__ = ["OPS", "OpDef", "lookup", "partition", "propagate", "tensors"]
