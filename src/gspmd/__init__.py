"""gspmd: annotate a JAX program with mesh_split, get one SPMD program for all devices.

    step = gspmd.jit(fn, mesh=mesh)      # like jax.jit; backend="sim" (default) or "jax"
    out = step(*args)                    # == fn(*args) on one device
    low = step.lower(*args)              # inspect: as_text(), report(), summary(), explain()

See help(gspmd.jit), help(gspmd.mesh_split) and docs/ in the repository.
"""
from gspmd.api import Lowered, Partitioned, jit
from gspmd.autoshard import Plan, auto
from gspmd.drawing import visualize
from gspmd.errors import ShardingError, UnpartitionedWarning
from gspmd.frontend import manual, mesh_split
from gspmd.mesh import Mesh
from gspmd.pipeline import pipeline, pipeline_loss, stage_major_order
from gspmd.sharding import UNSPECIFIED, Sharding
from gspmd.spmd.cost import Hardware

__all__ = ["Mesh", "Sharding", "ShardingError", "UnpartitionedWarning", "UNSPECIFIED", "mesh_split", "jit",
           "manual", "pipeline", "pipeline_loss", "stage_major_order", "visualize", "Partitioned", "Lowered",
           "Hardware", "auto", "Plan"]
