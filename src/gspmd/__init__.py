"""gspmd: annotate a JAX program with mesh_split, get one SPMD program for all devices."""
from gspmd.api import Lowered, Partitioned, jit
from gspmd.errors import ShardingError
from gspmd.frontend import manual, mesh_split
from gspmd.mesh import Mesh
from gspmd.pipeline import pipeline
from gspmd.sharding import UNSPECIFIED, Sharding

__all__ = ["Mesh", "Sharding", "ShardingError", "UNSPECIFIED", "mesh_split", "jit", "manual", "pipeline",
           "Partitioned", "Lowered"]
