"""Static analysis of SPMD programs: collectives and bytes, memory, FLOPs."""
from gspmd.analysis.hardware import PROFILES, Hardware
from gspmd.analysis.report import Collective, Report, analyse

__all__ = ["Collective", "Hardware", "PROFILES", "Report", "analyse"]
