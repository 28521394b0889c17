"""gspmd.auto: gspmd proposes the annotations (mesh shape and strategy) and writes
them as code the user keeps. (The package is not named auto: gspmd.auto is the function.)"""
from gspmd.autoshard.plan import Intermediate, Plan, RunnerUp
from gspmd.autoshard.search import auto

__all__ = ["auto", "Plan", "RunnerUp", "Intermediate"]
