"""Per-op knowledge, one module per op family, all registered in ops.registry.OPS."""
from gspmd.ops import collectives, dot, elementwise, reduce, shape, slicing  # noqa: F401  (registers)
from gspmd.ops.registry import OPS, OpDef, lookup, partition, propagate

__all__ = ["OPS", "OpDef", "lookup", "partition", "propagate"]
