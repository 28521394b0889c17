"""The op records hold all knowledge of their ops: code outside ops/ reads no opcode by
name (it asks the records' facets) and emits none by name (ir/emit.py's typed emitters
do). Checked on the syntax tree, so that attribute names and collective kinds that happen
to equal an opcode (`"sharding"`, `"all-gather"`) are not taken for one."""
from __future__ import annotations

import ast
from pathlib import Path

from gspmd.ops import OPS

SRC = Path(__file__).resolve().parents[1] / "src" / "gspmd"
EXEMPT = {"ops", "ir/emit.py"}   # where opcodes are spelled
EMITTERS = {"add", "add1"}   # Builder methods taking an opcode first


def _opcode_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in OPS


def _reads(tree: ast.AST) -> list[int]:
    """Lines comparing an `.opcode` with a literal opcode, or looking a record up by one."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "opcode" for s in sides) and any(
                    _opcode_literal(c) for s in sides for c in ast.walk(s)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name == "lookup" and node.args and _opcode_literal(node.args[0]):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
            name = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if name == "OPS" and _opcode_literal(node.slice):
                lines.append(node.lineno)
    return lines


def _emissions(tree: ast.AST) -> list[int]:
    """Lines building an instruction of a literal opcode (builder.add1("pad", ...),
    instr.remade(operands, out, "dynamic-slice"))."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in EMITTERS and node.args and _opcode_literal(node.args[0]):
                lines.append(node.lineno)
            elif node.func.attr == "remade" and (any(_opcode_literal(a) for a in node.args[2:3]) or any(
                    k.arg == "opcode" and _opcode_literal(k.value) for k in node.keywords)):
                lines.append(node.lineno)
    return lines


def _sources() -> dict[str, ast.AST]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.split("/")[0] in EXEMPT or rel in EXEMPT:
            continue
        out[rel] = ast.parse(path.read_text(), rel)
    return out


def test_no_opcode_is_read_by_name_outside_ops():
    found = {rel: lines for rel, tree in _sources().items() if (lines := _reads(tree))}
    assert found == {}, f"opcodes read by name (ask the op record's facets instead): {found}"


def test_no_opcode_is_emitted_by_name_outside_ops():
    found = {rel: lines for rel, tree in _sources().items() if (lines := _emissions(tree))}
    assert found == {}, f"instructions built by opcode name outside ops/ (use ir/emit.py's emitters): {found}"


def test_the_checks_see_what_they_look_for():
    tree = ast.parse('if p.opcode in ("pad", "slice"): b.add1("pad", [x], s, t)\n'
                     'lookup("dot"); x.opcode == "sharding"; held = u.remade([a], v, "dynamic-slice")')
    assert sorted(_reads(tree)) == [1, 2, 2]
    assert sorted(_emissions(tree)) == [1, 2]
