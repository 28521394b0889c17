"""gspmd.auto (this package, so named because gspmd.auto is the function): gspmd proposes the annotations (mesh shape and strategy) and writes them
as code the user keeps."""
from gspmd.autoshard.plan import Intermediate, Plan, RunnerUp
from gspmd.autoshard.search import auto

__all__ = ["auto", "Plan", "RunnerUp", "Intermediate"]
