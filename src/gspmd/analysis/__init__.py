"""Static analysis of SPMD programs: collectives and bytes, memory, FLOPs, step time."""
from gspmd.analysis.report import Collective, Report, analyse
from gspmd.spmd.cost import PROFILES, Hardware, Hosts, Torus

__all__ = ["Collective", "Hardware", "Hosts", "PROFILES", "Report", "Torus", "analyse"]
