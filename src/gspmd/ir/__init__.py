"""The HLO-like IR: SSA values, instructions, programs, a builder and its typed emitters
(ir.emit), printer and verifier."""
from gspmd.ir.program import Builder, Instr, Program, Value
from gspmd.ir.printer import format_program
from gspmd.ir.verifier import verify

__all__ = ["Builder", "Instr", "Program", "Value", "format_program", "verify"]
