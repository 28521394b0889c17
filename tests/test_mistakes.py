"""A corpus of common mistakes. Each must end in a clear gspmd.ShardingError (or, for an
annotation that does nothing, a warning) whose message names the value, says what is
wrong, and says what to do: three patterns per case, all of which must match."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
X = np.ones((8, 16), np.float32)
W = np.ones((16, 4), np.float32)


def split(dims_mapping, mesh=MESH, x=X):
    return gspmd.jit(lambda a: gspmd.mesh_split(a, mesh, dims_mapping) * 2).lower(x)


def mlp(x, w):
    return jnp.tanh(gspmd.mesh_split(x, MESH, ["data", None]) @ w)


def lowered():
    return gspmd.jit(mlp, mesh=MESH).lower(X, W)


def sub_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[4:8]), ("data",))


# (name, the mistake, [names the value, says the problem, says the fix])
MISTAKES = [
    # -- dims_mapping ---------------------------------------------------------------------------
    ("dims_mapping is a string", lambda: split("data"),
     [r"shape \(8, 16\)", "is a string", r"\['data', None\]"]),
    ("dims_mapping too long", lambda: split(["data", None, None]),
     [r"shape \(8, 16\)", "has 3 entries but .* rank 2", "one entry per tensor dim"]),
    ("dims_mapping too short", lambda: split(["data"]),
     [r"shape \(8, 16\)", "has 1 entries but .* rank 2", "one entry per tensor dim"]),
    ("unknown axis name", lambda: split(["dta", None]),
     [r"shape \(8, 16\)", "Unknown mesh axis 'dta'", r"axes \('data', 'model'\)"]),
    ("axis used twice", lambda: split(["data", "data"]),
     [r"shape \(8, 16\)", "more than once", "at most one tensor dim"]),
    ("mesh dim index out of range", lambda: split([2, None]),
     [r"shape \(8, 16\)", "out of range", r"use 0\.\.1 or an axis name"]),
    ("dims_mapping is a number", lambda: split(0),
     [r"shape \(8, 16\)", "not a sequence", r"\['data', None\]"]),
    ("bool as a mesh axis", lambda: split([True, None]),
     [r"shape \(8, 16\)", "must be a name or an int", "True"]),
    ("PartitionSpec longer than the rank", lambda: split(P("data", None, "model")),
     [r"shape \(8, 16\)", "has 3 entries but .* rank 2", "at most one entry per dim"]),
    ("PartitionSpec with an unknown axis", lambda: split(P("batch")),
     [r"shape \(8, 16\)", "Unknown mesh axis 'batch'", "has axes"]),
    ("no dims_mapping", lambda: gspmd.jit(lambda a: gspmd.mesh_split(a, MESH)).lower(X),
     [r"shape \(8, 16\)", "needs a dims_mapping", r"\['data', None\]"]),
    ("NamedSharding and a dims_mapping", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(a, NamedSharding(MESH.to_jax(), P("data")), ["data", None])).lower(X),
     ["NamedSharding", "already holds the spec", "drop the dims_mapping"]),
    # -- meshes -----------------------------------------------------------------------------------
    ("mesh is a NumPy array", lambda: split(["data", None], mesh=np.arange(8).reshape(2, 4)),
     [r"shape \(8, 16\)", "Expected a mesh", "gspmd.Mesh"]),
    ("mesh is None", lambda: split(["data", None], mesh=None),
     [r"shape \(8, 16\)", "Expected a mesh", "jax.sharding.Mesh"]),
    ("axis names as one string", lambda: gspmd.Mesh(np.arange(8), "data"),
     ["'data'", "one string", r"\('data',\)"]),
    ("duplicate devices", lambda: gspmd.Mesh([0, 1, 1, 3], ("x",)),
     [r"\[0, 1, 1, 3\]", r"duplicates: \[1\], missing: \[2\]", "np.arange"]),
    ("too few axis names", lambda: gspmd.Mesh(np.arange(8).reshape(2, 4), ("x",)),
     [r"shape \(2, 4\)", "needs 2 axis names", "one name per mesh dimension"]),
    ("repeated axis names", lambda: gspmd.Mesh(np.arange(4).reshape(2, 2), ("x", "x")),
     [r"\('x', 'x'\)", "repeat a name", "make them unique"]),
    ("float device ids", lambda: gspmd.Mesh(np.arange(4.0), ("x",)),
     ["float64", "must be integer device ids", "jax devices"]),
    ("annotation mesh of another size than jit's", lambda: gspmd.jit(mlp, mesh=gspmd.Mesh(np.arange(4), ("x",))).lower(X, W),
     [r"shape \(8, 16\)", "different sizes", "cover the same devices"]),
    ("annotation mesh over other devices than jit's", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(a, sub_mesh(), ["data", None]), mesh=gspmd.Mesh(np.arange(4), ("data",))).lower(X),
     [r"shape \(8, 16\)", "over different jax devices", "annotate over the jit's mesh"]),
    ("two annotations over different devices", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(gspmd.mesh_split(a, gspmd.Mesh(np.arange(4), ("data",)), ["data", None]),
                                   sub_mesh(), [None, "data"])).lower(X),
     [r"shape \(8, 16\)", "an earlier annotation", "same devices"]),
    ("mesh larger than jax's devices", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(a, gspmd.Mesh(np.arange(16).reshape(4, 4), ("x", "y")), ["x", "y"]),
        backend="jax")(np.ones((4, 4), np.float32)),
     ["16 devices", "jax has 8", "xla_force_host_platform_device_count=16"]),
    # -- gspmd.jit options --------------------------------------------------------------------------
    ("unknown backend", lambda: gspmd.jit(mlp, backend="gpu"),
     ["'gpu'", "Unknown backend", r"choose one of \('sim', 'jax'\)"]),
    ("misspelt jit keyword", lambda: gspmd.jit(mlp, static_argnum=1),
     ["'static_argnum'", "unknown keyword argument", "did you mean 'static_argnums'"]),
    ("jit of a non-function", lambda: gspmd.jit(X),
     ["ndarray", "needs a function", "gspmd.jit"]),
    ("jit mesh is a tuple", lambda: gspmd.jit(mlp, mesh=(2, 4)),
     [r"\(2, 4\)", "Expected a mesh", "gspmd.Mesh"]),
    ("static_argnums not ints", lambda: gspmd.jit(mlp, static_argnums="w"),
     ["'w'", "must be ints", "argument positions"]),
    ("donate_argnums not ints", lambda: gspmd.jit(mlp, donate_argnums=[0.5]),
     ["0.5", "must be ints", "argument positions"]),
    ("static_argnames not a parameter", lambda: gspmd.jit(mlp, static_argnames="lr"),
     ["'lr'", "not a parameter of mlp", r"\(x, w\)"]),
    ("in_shardings PartitionSpec without a mesh", lambda: gspmd.jit(mlp, in_shardings=(P("data"), None)).lower(X, W),
     ["PartitionSpec|P\\('data'", "without a mesh", "mesh=..."]),
    ("in_shardings of the wrong structure", lambda: gspmd.jit(
        mlp, mesh=MESH, in_shardings=(P("data"), None, None)).lower(X, W),
     ["in_shardings", "does not match the structure", "one PartitionSpec, NamedSharding or None per entry"]),
    # -- calling --------------------------------------------------------------------------------------
    ("unknown keyword argument", lambda: gspmd.jit(mlp, mesh=MESH)(X, W, lr=0.1),
     ["'lr'", "unknown keyword argument", r"parameters are \['x', 'w'\]"]),
    ("misspelt keyword argument", lambda: gspmd.jit(mlp, mesh=MESH)(X, wt=W),
     ["'wt'", "unknown keyword argument", "did you mean 'w'"]),
    ("too many arguments", lambda: gspmd.jit(mlp, mesh=MESH)(X, W, W),
     [r"mlp\(x, w\)", "cannot take these arguments", "too many positional arguments"]),
    ("missing argument", lambda: gspmd.jit(mlp, mesh=MESH)(X),
     [r"mlp\(x, w\)", "cannot take these arguments", "missing a required argument: 'w'"]),
    ("a string used as an array", lambda: gspmd.jit(mlp, mesh=MESH)("X", W),
     ["argument x", "is the string 'X'", "Pass a numeric array there"]),
    ("an array of strings", lambda: gspmd.jit(mlp, mesh=MESH)(np.array(["a", "b"]), W),
     ["Argument x", "dtype <U1", "convert it to numbers"]),
    ("an array of objects", lambda: gspmd.jit(mlp, mesh=MESH)(np.array([None, 1], dtype=object), W),
     ["Argument x", "dtype object", "static_argnums"]),
    ("an unhashable static argument", lambda: gspmd.jit(mlp, mesh=MESH, static_argnums=1)(X, np.ones(3)),
     ["static argument 1 of mlp", "not hashable", "make it hashable"]),
    ("Lowered called with another shape", lambda: lowered()(np.ones((4, 16), np.float32), W),
     [r"Argument x has shape \(4, 16\)", r"lowered for shape \(8, 16\)", "call the jitted function"]),
    ("Lowered called with too few arguments", lambda: lowered()(X),
     ["Expected 2 array arguments", "got 1", "array arguments"]),
    # -- inspection ------------------------------------------------------------------------------------
    ("explain of an unknown name", lambda: lowered().explain("w2"),
     ["'w2'", "No value named", r"name a parameter or result by its path \(x, w"]),
    ("explain of an output index out of range", lambda: lowered().explain(3),
     ["Output index 3", "out of range", "name a value instead"]),
    ("unknown hardware profile", lambda: lowered().report(hardware="tpu-v9"),
     ["'tpu-v9'", "Unknown hardware", "choose one of"]),
    ("estimates without hardware", lambda: lowered().report().step_seconds,
     ["Estimates", "need a hardware profile", "report\\(hardware='tpu-v3'\\)"]),
    ("visualize a 4-D value", lambda: gspmd.visualize(
        gspmd.jit(lambda a: gspmd.mesh_split(a, MESH, ["data"] + [None] * 3) + 1).lower(np.ones((2,) * 4, np.float32)),
        show=False),
     ["result float32\\[2,2,2,2\\]", "rank 4", "reshaped or sliced value"]),
    ("visualize a NumPy array", lambda: gspmd.visualize(X, show=False),
     ["ndarray", "draws a jax.Array or a value of a Lowered", r"step.lower\(\*args\), 'result\[0\]'"]),
    # -- other entry points ----------------------------------------------------------------------------------
    ("pipeline schedule misspelt", lambda: gspmd.pipeline(lambda p, x: x, np.ones((2, 3)), np.ones((4, 3)),
                                                         mesh=gspmd.Mesh(np.arange(8).reshape(2, 4), ("p", "x")),
                                                         stage_axis="p", schedule="1F1B"),
     ["'1F1B'", "Unknown pipeline schedule", r"choose one of \('gpipe', 'circular', '1f1b'\)"]),
]


@pytest.mark.parametrize("name,mistake,patterns", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_gets_a_clear_error(name, mistake, patterns):
    with pytest.raises(gspmd.ShardingError) as info:
        mistake()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{name}: {pattern!r} not in: {message}"


def test_the_corpus_is_large():
    assert len(MISTAKES) + 2 >= 40


@pytest.mark.filterwarnings("error::gspmd.UnpartitionedWarning")
@pytest.mark.parametrize("where", ["eagerly", "under jax.jit"])
def test_mesh_split_outside_gspmd_jit_warns_once_per_call_site(where, monkeypatch):
    from gspmd.frontend import annotation
    monkeypatch.setattr(annotation, "_warned_sites", set())

    def f(a):
        return gspmd.mesh_split(a, MESH, ["data", None]) * 2     # the call site
    run = f if where == "eagerly" else jax.jit(f)
    with pytest.warns(gspmd.UnpartitionedWarning) as caught:
        run(X)
        run(X + 1)
        jax.jit(f)(X + 2)
    (warning,) = caught
    message = str(warning.message)
    assert "shape (8, 16)" in message and "outside gspmd.jit" in message and "gspmd.jit(fn, mesh=...)" in message
    assert warning.filename == __file__


def test_no_warning_inside_gspmd_jit_or_when_handing_the_model_to_xla(recwarn):
    from gspmd.frontend.annotation import mesh_split_as
    from gspmd.runtime import jax_backend
    gspmd.jit(mlp, mesh=MESH)(X, W)
    with mesh_split_as(jax_backend.xla_constraint):
        jax.jit(mlp)(X, W)
    assert not [w for w in recwarn if issubclass(w.category, gspmd.UnpartitionedWarning)]
