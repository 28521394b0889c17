"""jaxpr -> Program, and the mesh_split annotation primitive."""
from gspmd.frontend.manual import manual
from gspmd.frontend.annotation import mesh_split, mesh_split_p
from gspmd.frontend.trace import trace

__all__ = ["manual", "mesh_split", "mesh_split_p", "trace"]
