"""Common-subexpression elimination after partitioning: a value resharded the same way
for several users is resharded once."""
import jax.numpy as jnp
import numpy as np

import gspmd
from gspmd.ir import Builder, Program
from gspmd.passes.cse import eliminate_common_subexpressions
from util import check, rand

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def test_one_gather_serves_three_einsums():
    def f(x, wq, wk, wv):
        x = gspmd.mesh_split(x, MESH, ["x", "y"])             # model dim over y
        ws = [gspmd.mesh_split(w, MESH, [-1, "y"]) for w in (wq, wk, wv)]
        return sum(jnp.tanh(x @ w) for w in ws)

    rng = np.random.RandomState(0)
    low = check(f, rand(rng, 8, 16), rand(rng, 16, 8), rand(rng, 16, 8), rand(rng, 16, 8), mesh=MESH)
    assert low.report().counts() == {"all-gather": 1}


def test_keeps_distinct_instructions_and_redirects_outputs():
    program = Program()
    b = Builder(program)
    x = b.param((4,), np.float32)
    one = b.add1("constant", [], (), np.float32, value=np.float32(1))
    again = b.add1("constant", [], (), np.float32, value=np.float32(1))
    two = b.add1("constant", [], (), np.float32, value=np.float32(2))
    s1 = b.add1("add", [x, b.add1("broadcast", [one], (4,), np.float32, dims=())], (4,), np.float32)
    s2 = b.add1("add", [x, b.add1("broadcast", [again], (4,), np.float32, dims=())], (4,), np.float32)
    program.outputs = [s1, s2, two]
    eliminate_common_subexpressions(program)
    assert [i.opcode for i in program.instrs] == ["constant", "constant", "broadcast", "add"]
    assert program.outputs[0] is program.outputs[1] is s1
