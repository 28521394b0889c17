"""Per-op knowledge, one module per op family, all registered in ops.registry.OPS."""
# Importing each op family registers its opcodes.
from gspmd.ops import (collectives, control, conv, dot, elementwise, gather_scatter, manual, reduce,  # noqa: F401
                       shape, slicing, sort, window)
from gspmd.ops.registry import (OPS, OUT_OF_SCOPE, PRIMITIVES, OpDef, informants, lookup, partition, propagate,
                                runs, tensors)

__all__ = ["OPS", "OUT_OF_SCOPE", "PRIMITIVES", "OpDef", "informants", "lookup", "partition", "propagate", "runs",
           "tensors"]
