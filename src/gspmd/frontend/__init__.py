"""jaxpr -> Program, and the mesh_split annotation primitive."""
from gspmd.frontend.manual import manual
from gspmd.frontend.annotation import mesh_split, mesh_split_p
from gspmd.frontend.trace import record_schedule, trace

__all__ = ["manual", "mesh_split", "mesh_split_p", "record_schedule", "trace"]
