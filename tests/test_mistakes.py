"""A corpus of common mistakes, by family. Each must end in a clear gspmd.ShardingError
(or, for an annotation that does nothing, a warning) whose message names the value, says
what is wrong, and says what to do: three patterns per case, all of which must match.
Every case says which argument of which public function it gets wrong, and every
argument of every public function has at least one case (test_every_argument_is_covered)."""
import inspect
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gspmd
from gspmd.autoshard.search import Effort
from gspmd.spmd.cost import Hosts

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("data", "model"))
X = np.ones((8, 16), np.float32)
W = np.ones((16, 4), np.float32)
RAGGED = [[1.0, 2.0], [3.0]]
PIPE_MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("p", "x"))
STACKED, MICROBATCHES = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)


def split(dims_mapping, mesh=MESH, x=X):
    return gspmd.jit(lambda a: gspmd.mesh_split(a, mesh, dims_mapping) * 2).lower(x)


def mlp(x, w):
    return jnp.tanh(gspmd.mesh_split(x, MESH, ["data", None]) @ w)


def lowered():
    return gspmd.jit(mlp, mesh=MESH).lower(X, W)


def sub_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[4:8]), ("data",))


def manual(fn=lambda a: a * 2, in_specs=(["data", None],), out_specs=["data", None], manual_axes=None, mesh=MESH,
           args=(X,)):
    return gspmd.manual(fn, mesh, in_specs, out_specs, manual_axes=manual_axes)(*args)


def stage(p, x):
    return x * p


def pipeline(stage_fn=stage, stacked_params=STACKED, microbatches=MICROBATCHES, **options):
    options = {"mesh": PIPE_MESH, "stage_axis": "p", **options}
    return gspmd.pipeline(stage_fn, stacked_params, microbatches, **options)


def pipeline_loss(loss_fn=lambda y, t: jnp.sum((y - t) ** 2), targets=MICROBATCHES, **options):
    options = {"mesh": PIPE_MESH, "stage_axis": "p", **options}
    return gspmd.pipeline_loss(stage, loss_fn, STACKED, MICROBATCHES, targets, **options)


def matmul(x, w):
    return jnp.tanh(x @ w)


def hardware(**fields):
    base = dict(name="mine", flops_per_s=1e12, memory_bytes=1 << 30, hbm_bytes_per_s=1e11,
                interconnect=Hosts(8, 1e9, 1e-6, 1e9, 1e-6))
    return gspmd.Hardware(**{**base, **fields})


# Each case: (the argument it gets wrong, name, the mistake, [names the value, says the problem, says the fix]).
# Arguments are named "function.parameter" after the public signatures (see PUBLIC below).
DIMS_MAPPING = [
    ("mesh_split.dims_mapping", "a string", lambda: split("data"),
     [r"shape \(8, 16\)", "is a string", r"\['data', None\]"]),
    ("mesh_split.dims_mapping", "too long", lambda: split(["data", None, None]),
     [r"shape \(8, 16\)", "has 3 entries but .* rank 2", "one entry per tensor dim"]),
    ("mesh_split.dims_mapping", "too short", lambda: split(["data"]),
     [r"shape \(8, 16\)", "has 1 entries but .* rank 2", "one entry per tensor dim"]),
    ("mesh_split.dims_mapping", "unknown axis name", lambda: split(["dta", None]),
     [r"shape \(8, 16\)", "Unknown mesh axis 'dta'", r"axes \('data', 'model'\)"]),
    ("mesh_split.dims_mapping", "unknown axis inside a tuple", lambda: split([("data", "zz"), None]),
     [r"entry \('data', 'zz'\)", "Unknown mesh axis 'zz'", r"axes \('data', 'model'\)"]),
    ("mesh_split.dims_mapping", "axis used twice", lambda: split(["data", "data"]),
     [r"shape \(8, 16\)", "more than once", "at most one tensor dim"]),
    ("mesh_split.dims_mapping", "axis used twice in one tuple", lambda: split([("data", "data"), None]),
     [r"\[\('data', 'data'\), None\]", "more than once", "at most one tensor dim"]),
    ("mesh_split.dims_mapping", "mesh dim index out of range", lambda: split([2, None]),
     [r"shape \(8, 16\)", "out of range", r"use 0\.\.1 or an axis name"]),
    ("mesh_split.dims_mapping", "negative mesh dim other than -1", lambda: split([-2, None]),
     ["entry -2", "out of range", r"use 0\.\.1 or an axis name"]),
    ("mesh_split.dims_mapping", "a number", lambda: split(0),
     [r"shape \(8, 16\)", "not a sequence", r"\['data', None\]"]),
    ("mesh_split.dims_mapping", "a set (no order)", lambda: split({"data", None}),
     ["of type set", "not a sequence .* in order", r"\['data', None\]"]),
    ("mesh_split.dims_mapping", "a dict", lambda: split({0: "data"}),
     [r"\{0: 'data'\}", "of type dict", r"\['data', None\]"]),
    ("mesh_split.dims_mapping", "a generator", lambda: split(e for e in ["data", None]),
     ["generator", "not a sequence", r"\['data', None\]"]),
    ("mesh_split.dims_mapping", "a NumPy array of names", lambda: split(np.array(["data", "None"])),
     ["of type ndarray", "not a sequence", "or a PartitionSpec"]),
    ("mesh_split.dims_mapping", "bytes", lambda: split(b"data"),
     ["b'data'", "of type bytes", r"\['data', None\]"]),
    ("mesh_split.dims_mapping", "bool as a mesh axis", lambda: split([True, None]),
     [r"shape \(8, 16\)", "must be a name or an int", "True"]),
    ("mesh_split.dims_mapping", "float as a mesh axis", lambda: split([0.5, None]),
     ["entry 0.5", "must be a name or an int", r"axis name from|name or an int"]),
    ("mesh_split.dims_mapping", "PartitionSpec longer than the rank", lambda: split(P("data", None, "model")),
     [r"shape \(8, 16\)", "has 3 entries but .* rank 2", "at most one entry per dim"]),
    ("mesh_split.dims_mapping", "PartitionSpec with an unknown axis", lambda: split(P("batch")),
     [r"shape \(8, 16\)", "Unknown mesh axis 'batch'", "has axes"]),
    ("mesh_split.dims_mapping", "none given", lambda: gspmd.jit(lambda a: gspmd.mesh_split(a, MESH)).lower(X),
     [r"shape \(8, 16\)", "needs a dims_mapping", r"\['data', None\]"]),
    ("mesh_split.dims_mapping", "NamedSharding and a dims_mapping", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(a, NamedSharding(MESH.to_jax(), P("data")), ["data", None])).lower(X),
     ["NamedSharding", "already holds the spec", "drop the dims_mapping"]),
]

ARRAYS = [   # an argument that is not an array: strings, None, dicts, nested (ragged) lists
    ("mesh_split.x", "a ragged nested list", lambda: gspmd.jit(lambda: gspmd.mesh_split(RAGGED, MESH, [None]))(),
     [r"\[\[1\.0, 2\.0\], \[3\.0\]\]", "not a rectangular array", r"np\.asarray"]),
    ("mesh_split.x", "None", lambda: gspmd.jit(lambda: gspmd.mesh_split(None, MESH, []))(),
     ["annotates is None,", "not an array", "NumPy or jax array"]),
    ("mesh_split.x", "a dict", lambda: gspmd.jit(lambda a: gspmd.mesh_split({"a": a}, MESH, ["data"]))(X),
     ["dict", "not an array", "NumPy or jax array"]),
    ("mesh_split.x", "a string", lambda: gspmd.jit(lambda: gspmd.mesh_split("x", MESH, []))(),
     ["the string 'x'", "not an array", "NumPy or jax array"]),
    ("Partitioned.__call__.*args", "a string used as an array", lambda: gspmd.jit(mlp, mesh=MESH)("X", W),
     ["argument x", "is the string 'X'", "Pass a numeric array there"]),
    ("Partitioned.__call__.*args", "a ragged list", lambda: gspmd.jit(matmul, mesh=MESH)(RAGGED, W),
     ["argument x", "is a list of Python numbers", r"np\.asarray of a rectangular list"]),
    ("Partitioned.__call__.*args", "a rectangular list", lambda: gspmd.jit(matmul, mesh=MESH)(X.tolist(), W),
     ["argument x", "is a list of Python numbers", "passes non-array arguments through unchanged"]),
    ("Partitioned.lower.*args", "a ragged list into an annotation", lambda: gspmd.jit(mlp, mesh=MESH).lower(RAGGED, W),
     ["mesh_split annotates", "not a rectangular array", r"np\.asarray"]),
    ("Partitioned.__call__.*args", "an array of strings", lambda: gspmd.jit(mlp, mesh=MESH)(np.array(["a", "b"]), W),
     ["Argument x", "dtype <U1", "convert it to numbers"]),
    ("Partitioned.__call__.*args", "an array of objects",
     lambda: gspmd.jit(mlp, mesh=MESH)(np.array([None, 1], dtype=object), W),
     ["Argument x", "dtype object", "static_argnums"]),
    ("Partitioned.lower.*args", "a ShapeDtypeStruct of strings",
     lambda: gspmd.jit(mlp, mesh=MESH).lower(jax.ShapeDtypeStruct((8, 16), np.str_), W),
     ["Argument x", "dtype <U", "convert it to numbers"]),
    ("manual.fn", "a ragged argument of fn's region", lambda: manual(args=(RAGGED,)),
     ["Argument 0 of gspmd.manual", "not a rectangular array", r"np\.asarray"]),
    ("pipeline.microbatches", "ragged microbatches", lambda: pipeline(microbatches=RAGGED),
     ["microbatches of gspmd.pipeline", "not a rectangular array", r"np\.asarray"]),
    ("pipeline.microbatches", "None", lambda: pipeline(microbatches=None),
     ["microbatches of gspmd.pipeline is None,", "not an array", "NumPy or jax array"]),
    ("pipeline.microbatches", "a scalar", lambda: pipeline(microbatches=np.float32(1)),
     [r"shape \(\)", "at least one microbatch", r"\[M, \*microbatch\]"]),
    ("pipeline.stacked_params", "a ragged list of layers", lambda: pipeline(stacked_params=[[1.0, 2.0], [3.0]]),
     ["Stacked parameter float 1.0", "must have a leading layer dim", "2 stages x 1 repeats"]),
    ("pipeline_loss.targets", "one target short", lambda: pipeline_loss(targets=np.ones((3, 3), np.float32)),
     [r"targets of gspmd.pipeline_loss of shape \(3, 3\)", "must have a leading microbatch dim",
      "one per microbatch = 4"]),
    ("pipeline_loss.microbatches", "ragged", lambda: gspmd.pipeline_loss(
        stage, lambda y, t: y, STACKED, RAGGED, RAGGED, mesh=PIPE_MESH, stage_axis="p"),
     ["microbatches of gspmd.pipeline", "not a rectangular array", r"np\.asarray"]),
    ("pipeline_loss.stacked_params", "of the wrong length", lambda: gspmd.pipeline_loss(
        stage, lambda y, t: y, np.ones((3, 3)), MICROBATCHES, MICROBATCHES, mesh=PIPE_MESH, stage_axis="p"),
     [r"shape \(3, 3\)", "must have a leading layer dim", "2 stages x 1 repeats"]),
    ("stage_major_order.stacked_params", "layers that do not match", lambda: gspmd.stage_major_order(
        np.ones((4, 3)), 3, 2), [r"shape \(4, 3\)", "must have a leading layer dim", "3 stages x 2 repeats = 6"]),
    ("stage_major_order.stacked_params", "a scalar", lambda: gspmd.stage_major_order(np.float32(1), 2, 2),
     [r"shape \(\)", "must have a leading layer dim", "= 4"]),
    ("auto.*args", "a ragged list", lambda: gspmd.auto(matmul, RAGGED, W, devices=2),
     ["Argument 0 of gspmd.auto", "not a rectangular array", r"np\.asarray"]),
    ("auto.*args", "a string", lambda: gspmd.auto(matmul, "x", W, devices=2),
     ["Argument x", "dtype <U1", "convert it to numbers"]),
]

MESHES = [
    ("mesh_split.mesh", "a NumPy array", lambda: split(["data", None], mesh=np.arange(8).reshape(2, 4)),
     [r"shape \(8, 16\)", "Expected a mesh", "gspmd.Mesh"]),
    ("mesh_split.mesh", "None", lambda: split(["data", None], mesh=None),
     [r"shape \(8, 16\)", "Expected a mesh", "jax.sharding.Mesh"]),
    ("Mesh.axis_names", "one string", lambda: gspmd.Mesh(np.arange(8), "data"),
     ["'data'", "one string", r"\('data',\)"]),
    ("Mesh.axis_names", "None", lambda: gspmd.Mesh(np.arange(4), None),
     ["got None", "tuple of non-empty strings", r"e\.g\. \('data', 'model'\)"]),
    ("Mesh.axis_names", "a number", lambda: gspmd.Mesh(np.arange(4), 3),
     ["got 3", "tuple of non-empty strings", "one per mesh dimension"]),
    ("Mesh.axis_names", "a set (no order)", lambda: gspmd.Mesh(np.arange(4), {"x"}),
     [r"\{'x'\}", r"tuple of non-empty strings, one per mesh dimension \(in order\)", r"e\.g\."]),
    ("Mesh.axis_names", "ints", lambda: gspmd.Mesh(np.arange(4), (0,)),
     [r"\(0,\)", "non-empty strings", r"e\.g\."]),
    ("Mesh.axis_names", "an empty name", lambda: gspmd.Mesh(np.arange(4), ("",)),
     [r"\('',\)", "non-empty strings", r"e\.g\."]),
    ("Mesh.axis_names", "too few", lambda: gspmd.Mesh(np.arange(8).reshape(2, 4), ("x",)),
     [r"shape \(2, 4\)", "needs 2 axis names", "one name per mesh dimension"]),
    ("Mesh.axis_names", "repeated", lambda: gspmd.Mesh(np.arange(4).reshape(2, 2), ("x", "x")),
     [r"\('x', 'x'\)", "repeat a name", "make them unique"]),
    ("Mesh.devices", "duplicates", lambda: gspmd.Mesh([0, 1, 1, 3], ("x",)),
     [r"\[0, 1, 1, 3\]", r"duplicates: \[1\], missing: \[2\]", "np.arange"]),
    ("Mesh.devices", "floats", lambda: gspmd.Mesh(np.arange(4.0), ("x",)),
     ["float64", "must be integer device ids", "jax devices"]),
    ("Mesh.devices", "ragged", lambda: gspmd.Mesh([[0, 1], [2]], ("x", "y")),
     [r"\[\[0, 1\], \[2\]\]", "not a rectangular array", r"np\.arange\(8\)\.reshape\(2, 4\)"]),
    ("Mesh.devices", "none", lambda: gspmd.Mesh([], ("x",)),
     [r"got \[\]", "must be integer device ids", r"np\.arange"]),
    ("Mesh.devices", "strings", lambda: gspmd.Mesh(["a", "b"], ("x",)),
     [r"\['a', 'b'\]", "must be integer device ids", r"np\.arange"]),
    ("Mesh.from_jax.mesh", "a gspmd.Mesh", lambda: gspmd.Mesh.from_jax(MESH),
     [r"gspmd Mesh\(data=2, model=4\)", "needs a jax.sharding.Mesh", "use it as it is"]),
    ("Mesh.from_jax.mesh", "an abstract mesh", lambda: gspmd.Mesh.from_jax(MESH.to_jax().abstract_mesh),
     ["AbstractMesh", "needs a jax.sharding.Mesh with devices", "jax.set_mesh"]),
    ("Mesh.axis_index.axis", "a float", lambda: MESH.axis_index(1.0),
     ["1.0", "must be a name or an int", r"Mesh\(data=2, model=4\)"]),
    ("jit.mesh", "a tuple", lambda: gspmd.jit(mlp, mesh=(2, 4)),
     [r"\(2, 4\)", "Expected a mesh", "gspmd.Mesh"]),
    ("jit.mesh", "an axis name", lambda: gspmd.jit(mlp, mesh="data"),
     ["'data'", "Expected a mesh", "jax.make_mesh"]),
    ("jit.mesh", "another size than the annotations'",
     lambda: gspmd.jit(mlp, mesh=gspmd.Mesh(np.arange(4), ("x",))).lower(X, W),
     [r"shape \(8, 16\)", "different sizes", "cover the same devices"]),
    ("jit.mesh", "other devices than the annotations'", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(a, sub_mesh(), ["data", None]), mesh=gspmd.Mesh(np.arange(4), ("data",))).lower(X),
     [r"shape \(8, 16\)", "over different jax devices", "annotate over the jit's mesh"]),
    ("mesh_split.mesh", "two annotations over different devices", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(gspmd.mesh_split(a, gspmd.Mesh(np.arange(4), ("data",)), ["data", None]),
                                   sub_mesh(), [None, "data"])).lower(X),
     [r"shape \(8, 16\)", "an earlier annotation", "same devices"]),
    ("mesh_split.mesh", "larger than jax's devices", lambda: gspmd.jit(
        lambda a: gspmd.mesh_split(a, gspmd.Mesh(np.arange(16).reshape(4, 4), ("x", "y")), ["x", "y"]),
        backend="jax")(np.ones((4, 4), np.float32)),
     ["16 devices", "jax has 8", "xla_force_host_platform_device_count=16"]),
    ("manual.mesh", "an axis name", lambda: manual(mesh="data"),
     ["'data'", "Expected a mesh for gspmd.manual", "gspmd.Mesh"]),
    ("pipeline.mesh", "None", lambda: pipeline(mesh=None),
     ["NoneType None", "Expected a mesh for gspmd.pipeline", "jax.sharding.Mesh"]),
    ("pipeline.stage_axis", "unknown", lambda: pipeline(stage_axis="q"),
     ["stage_axis='q'", "Unknown mesh axis", r"axes \('p', 'x'\)"]),
    ("pipeline.stage_axis", "None", lambda: pipeline(stage_axis=None),
     ["stage_axis=None", "must be a name or an int", r"Mesh\(p=2, x=4\)"]),
    ("pipeline_loss.mesh", "a tuple", lambda: pipeline_loss(mesh=(2, 4)),
     [r"\(2, 4\)", "Expected a mesh for gspmd.pipeline", "gspmd.Mesh"]),
    ("pipeline_loss.stage_axis", "unknown", lambda: pipeline_loss(stage_axis="stages"),
     ["'stages'", "Unknown mesh axis", r"axes \('p', 'x'\)"]),
    ("auto.mesh", "a string", lambda: gspmd.auto(matmul, X, W, mesh="x"),
     ["'x'", "Expected a mesh for gspmd.auto", "gspmd.Mesh"]),
    ("auto.mesh", "and another device count", lambda: gspmd.auto(matmul, X, W, mesh=MESH, devices=4),
     ["devices=4", "a mesh of 8", "pass one of them"]),
]

TILE_ASSIGNMENTS = [   # gspmd.Sharding's constructors and the methods that read it in a mesh's terms
    ("Sharding.tile_assignment", "ragged", lambda: gspmd.Sharding([[0, 1], [2]]),
     [r"\[\[0, 1\], \[2\]\]", "not a rectangular array", r"Sharding\.from_mesh"]),
    ("Sharding.tile_assignment", "a string", lambda: gspmd.Sharding("abc"),
     ["the string 'abc'", "integer array", r"Sharding\.from_mesh"]),
    ("Sharding.tile_assignment", "a scalar", lambda: gspmd.Sharding(3),
     ["int 3", "then the replication dim", r"Sharding\.replicated"]),
    ("Sharding.tile_assignment", "floats", lambda: gspmd.Sharding([0.5, 1.5]),
     [r"\[0\.5, 1\.5\]", "integer array", r"Sharding\.from_mesh"]),
    ("Sharding.tile_assignment", "a device twice", lambda: gspmd.Sharding([[0, 0]]),
     [r"\[\[0, 0\]\]", "each device id 0..N-1 once", r"Sharding\.from_mesh"]),
    ("Sharding.replicated.rank", "negative", lambda: gspmd.Sharding.replicated(-1, 8),
     ["Sharding.replicated\\(rank\\)", "whole number >= 0", "int -1"]),
    ("Sharding.replicated.rank", "a string", lambda: gspmd.Sharding.replicated("2", 8),
     ["the string '2'", "whole number >= 0", "pass e.g."]),
    ("Sharding.replicated.num_devices", "zero", lambda: gspmd.Sharding.replicated(2, 0),
     ["num_devices", "whole number >= 1", "int 0"]),
    ("Sharding.tiled.devices", "ragged", lambda: gspmd.Sharding.tiled([[0, 1], [2]]),
     [r"\[\[0, 1\], \[2\]\]", "not a rectangular array", r"Sharding\.from_mesh"]),
    ("Sharding.from_mesh.shape", "an int", lambda: gspmd.Sharding.from_mesh(MESH, ["data", None], 8),
     ["int 8", "shape must be a tuple of non-negative ints", r"\(8, 16\)"]),
    ("Sharding.from_mesh.shape", "a negative dim", lambda: gspmd.Sharding.from_mesh(MESH, ["data", None], (-1, 2)),
     [r"\(-1, 2\)", "non-negative ints", r"e\.g\. \(8, 16\)"]),
    ("Sharding.from_mesh.mesh", "a list", lambda: gspmd.Sharding.from_mesh([2, 4], ["data", None], (8, 16)),
     [r"\[2, 4\]", "Expected a mesh", "gspmd.Mesh"]),
    ("Sharding.from_mesh.dims_mapping", "a set", lambda: gspmd.Sharding.from_mesh(MESH, {"data"}, (8, 16)),
     ["of type set", "not a sequence", r"\['data', None\]"]),
    ("Sharding.from_named.named", "a PartitionSpec", lambda: gspmd.Sharding.from_named(P("data"), (8, 16)),
     [r"P\('data',\)", "needs a jax.sharding.NamedSharding", r"Sharding\.from_mesh\(mesh, spec, shape\)"]),
    ("Sharding.from_named.shape", "None", lambda: gspmd.Sharding.from_named(NamedSharding(MESH.to_jax(), P()), None),
     ["None", "shape must be a tuple", r"\(8, 16\)"]),
    ("Sharding.merge.other", "a string", lambda: gspmd.Sharding.replicated(2, 8).merge("x"),
     ["the string 'x'", "needs another Sharding", "Sharding"]),
    ("Sharding.merge.shape", "another rank", lambda: gspmd.Sharding.replicated(2, 8).merge(
        gspmd.Sharding.replicated(2, 8), (8,)), [r"shape \(8,\) of rank 1", "layouts of rank 2", "shape of the value"]),
    ("Sharding.spec.mesh", "a string", lambda: gspmd.Sharding.replicated(2, 8).spec("x"),
     ["'x'", "Expected a mesh", "gspmd.Mesh"]),
    ("Sharding.dims_mapping.mesh", "None", lambda: gspmd.Sharding.replicated(2, 8).dims_mapping(None),
     ["None", "Expected a mesh", "jax.sharding.Mesh"]),
    ("Sharding.describe.*meshes", "a string", lambda: gspmd.Sharding.replicated(2, 8).describe("x"),
     ["'x'", "Expected a mesh for Sharding.describe", "gspmd.Mesh"]),
]

POSITIONS = [   # static/donated arguments, by position or by name
    ("jit.static_argnums", "a string", lambda: gspmd.jit(mlp, static_argnums="w"),
     ["'w'", "must be ints", "argument positions"]),
    ("jit.static_argnums", "a float", lambda: gspmd.jit(mlp, static_argnums=1.0),
     ["1.0", "must be ints", r"static_argnums=\(1,\)"]),
    ("jit.static_argnums", "out of range", lambda: gspmd.jit(mlp, static_argnums=5),
     [r"static_argnums=\(5,\)", r"mlp\(x, w\) takes 2 positional arguments", r"use 0\.\.1"]),
    ("jit.static_argnums", "negative, out of range", lambda: gspmd.jit(mlp, static_argnums=-3),
     ["position -3", "takes 2 positional arguments", r"-2\.\.-1"]),
    ("jit.donate_argnums", "not ints", lambda: gspmd.jit(mlp, donate_argnums=[0.5]),
     ["0.5", "must be ints", "argument positions"]),
    ("jit.donate_argnums", "out of range", lambda: gspmd.jit(mlp, donate_argnums=7),
     [r"donate_argnums=\(7,\)", "takes 2 positional arguments", "donate_argnames"]),
    ("jit.static_argnames", "not a parameter", lambda: gspmd.jit(mlp, static_argnames="lr"),
     ["'lr'", "not a parameter of mlp", r"\(x, w\)"]),
    ("jit.static_argnames", "an int", lambda: gspmd.jit(mlp, static_argnames=1),
     ["got 1", "must be strings", r"static_argnames=\('w',\)"]),
    ("jit.donate_argnames", "misspelt", lambda: gspmd.jit(mlp, donate_argnames="xx"),
     ["'xx'", "not a parameter of mlp", "did you mean 'x'"]),
    ("jit.donate_argnames", "an int", lambda: gspmd.jit(mlp, donate_argnames=0),
     ["got 0", "must be strings", "parameter names"]),
    ("jit.donate_argnums", "static and donated", lambda: gspmd.jit(mlp, static_argnums=1, donate_argnums=1),
     ["Argument 'w' of mlp", "both static and donated", "drop it from"]),
    ("Partitioned.__call__.*args", "an unhashable static argument",
     lambda: gspmd.jit(mlp, mesh=MESH, static_argnums=1)(X, np.ones(3)),
     ["static argument 1 of mlp", "not hashable", "make it hashable"]),
]

JIT_OPTIONS = [
    ("jit.backend", "unknown", lambda: gspmd.jit(mlp, backend="gpu"),
     ["'gpu'", "Unknown backend", r"choose one of \('sim', 'jax'\)"]),
    ("jit.backend", "None", lambda: gspmd.jit(mlp, backend=None),
     ["None", "Unknown backend", r"choose one of \('sim', 'jax'\)"]),
    ("jit.**unknown", "a misspelt keyword", lambda: gspmd.jit(mlp, static_argnum=1),
     ["'static_argnum'", "unknown keyword argument", "did you mean 'static_argnums'"]),
    ("jit.**unknown", "one device", lambda: gspmd.jit(mlp, device=jax.devices()[0]),
     ["not one `device`", "mesh=", r"jax\.jit\(device=\.\.\.\)"]),
    ("jit.compiler_options", "on the sim backend", lambda: gspmd.jit(mlp, compiler_options={"xla_foo": 1}),
     [r"\['xla_foo'\]", "sim backend compiles nothing", "backend='jax'"]),
    ("jit.compiler_options", "a string", lambda: gspmd.jit(mlp, backend="jax", compiler_options="xla_foo=1"),
     ["str 'xla_foo=1'", "takes a dict of XLA option names"]),
    ("jit.keep_unused", "a string", lambda: gspmd.jit(mlp, keep_unused="yes"),
     ["str 'yes'", "takes True or False"]),
    ("jit.inline", "None", lambda: gspmd.jit(mlp, inline=None),
     ["NoneType None", "takes True or False"]),
    ("jit.fn", "not a function", lambda: gspmd.jit(X),
     ["ndarray", "needs a function", "gspmd.jit"]),
    ("jit.memory_limit", "a string", lambda: gspmd.jit(mlp, memory_limit="1GB"),
     ["the string '1GB'", "needs a whole number >= 1", r"8 \* 2\*\*30 \(bytes per device\)"]),
    ("jit.memory_limit", "a bool", lambda: gspmd.jit(mlp, memory_limit=True),
     ["bool True", "needs a whole number >= 1", "bytes per device"]),
    ("jit.memory_limit", "negative", lambda: gspmd.jit(mlp, memory_limit=-1),
     ["int -1", "needs a whole number >= 1", "bytes per device"]),
    ("jit.hardware", "unknown", lambda: gspmd.jit(mlp, hardware="tpu-v9"),
     ["'tpu-v9'", "Unknown hardware", "choose one of"]),
    ("jit.hardware", "a list", lambda: gspmd.jit(mlp, hardware=["tpu-v3"]),
     [r"\['tpu-v3'\]", "Unknown hardware", r"gspmd\.Hardware\(\.\.\.\)"]),
    ("Plan.jit.backend", "unknown", lambda: gspmd.Plan.jit(SimpleNamespace(
        function=lambda: mlp, mesh=MESH, memory_limit=None, report=SimpleNamespace(hardware=None)), backend="gpu"),
     ["'gpu'", "Unknown backend", "choose one of"]),
]

LAYOUTS = [   # in_shardings and out_shardings
    ("jit.in_shardings", "a PartitionSpec without a mesh", lambda: gspmd.jit(mlp, in_shardings=(P("data"), None)),
     ["P\\('data'", "without a mesh", "mesh=..."]),
    ("jit.in_shardings", "of the wrong structure", lambda: gspmd.jit(
        mlp, mesh=MESH, in_shardings=(P("data"), None, None)).lower(X, W),
     ["in_shardings", "does not match the structure", "one PartitionSpec, NamedSharding or None per entry"]),
    ("jit.in_shardings", "with keyword arguments (as jax.jit)",
     lambda: gspmd.jit(mlp, mesh=MESH, in_shardings=(P("data"), None)).lower(X, w=W),
     [r"keyword arguments \['w'\]", "cover the positional arguments only", "pass them by position"]),
    ("jit.in_shardings", "an axis name", lambda: gspmd.jit(mlp, mesh=MESH, in_shardings="data"),
     ["the string 'data'", "in_shardings holds", r"in_shardings=\(P\('data', None\), None\)"]),
    ("jit.in_shardings", "dims_mappings instead of PartitionSpecs",
     lambda: gspmd.jit(mlp, mesh=MESH, in_shardings=(["data", None], None)),
     ["the string 'data'", "in_shardings holds", "one PartitionSpec, NamedSharding or None per entry"]),
    ("jit.in_shardings", "an unknown axis", lambda: gspmd.jit(mlp, mesh=MESH, in_shardings=(P("zz"), None)).lower(X, W),
     [r"in_shardings \(P\('zz',\), None\)", "Unknown mesh axis 'zz'", r"has axes \('data', 'model'\)"]),
    ("jit.in_shardings", "a spec longer than the rank",
     lambda: gspmd.jit(mlp, mesh=MESH, in_shardings=(P("data", None, None), None)).lower(X, W),
     [r"shape \(8, 16\)", "has 3 entries", "at most one entry per dim"]),
    ("jit.out_shardings", "a gspmd.Sharding", lambda: gspmd.jit(mlp, mesh=MESH,
                                                                out_shardings=gspmd.Sharding.replicated(2, 8)),
     ["replicated", "out_shardings holds", "PartitionSpec, NamedSharding or None"]),
    ("jit.out_shardings", "of the wrong structure",
     lambda: gspmd.jit(mlp, mesh=MESH, out_shardings=(P("data"), P())).lower(X, W),
     ["out_shardings", "does not match the structure of the result", "a prefix of its pytree"]),
]

CALLS = [   # calling a jitted or lowered function
    ("Partitioned.__call__.**kwargs", "an unknown keyword", lambda: gspmd.jit(mlp, mesh=MESH)(X, W, lr=0.1),
     ["'lr'", "unknown keyword argument", r"parameters are \['x', 'w'\]"]),
    ("Partitioned.__call__.**kwargs", "a misspelt keyword", lambda: gspmd.jit(mlp, mesh=MESH)(X, wt=W),
     ["'wt'", "unknown keyword argument", "did you mean 'w'"]),
    ("Partitioned.lower.**kwargs", "an unknown keyword", lambda: gspmd.jit(mlp, mesh=MESH).lower(X, W, lr=0.1),
     ["'lr'", "unknown keyword argument", r"parameters are \['x', 'w'\]"]),
    ("Partitioned.__call__.*args", "too many", lambda: gspmd.jit(mlp, mesh=MESH)(X, W, W),
     [r"mlp\(x, w\)", "cannot take these arguments", "too many positional arguments"]),
    ("Partitioned.lower.*args", "one missing", lambda: gspmd.jit(mlp, mesh=MESH).lower(X),
     [r"mlp\(x, w\)", "cannot take these arguments", "missing a required argument: 'w'"]),
    ("Lowered.__call__.*args", "another shape", lambda: lowered()(np.ones((4, 16), np.float32), W),
     [r"Argument x has shape \(4, 16\)", r"lowered for shape \(8, 16\)", "call the jitted function"]),
    ("Lowered.__call__.*args", "another dtype", lambda: lowered()(X.astype(np.int32), W),
     ["Argument x .* dtype int32", "lowered for .* dtype float32", "call the jitted function"]),
    ("Lowered.__call__.*args", "another dtype, jax backend",
     lambda: gspmd.jit(mlp, mesh=MESH, backend="jax").lower(X, W)(X, W.astype(np.float16)),
     ["Argument w .* dtype float16", "lowered for .* dtype float32", "lower anew"]),
    ("Lowered.__call__.*args", "too few", lambda: lowered()(X),
     ["Expected 2 array arguments", "got 1", r"x: float32\[8,16\], w: float32\[16,4\]"]),
    ("Lowered.__call__.*args", "too many", lambda: lowered()(X, W, W),
     ["Expected 2 array arguments", "got 3", "lower anew"]),
    ("Lowered.__call__.*args", "a string for an array", lambda: lowered()("X", W),
     ["Argument x is the string 'X'", r"lowered for shape \(8, 16\)", "call the jitted function"]),
    ("Lowered.__call__.*args", "a ragged list for an array", lambda: lowered()(RAGGED, W),
     ["Expected 2 array arguments", "got 1", "call the jitted function"]),
    ("Lowered.__call__.*args", "another pytree structure", lambda: lowered()((X,), W),
     ["mlp was lowered", "another pytree structure", r"x: float32\[8,16\]"]),
    ("Lowered.__call__.*args", "another static value", lambda: gspmd.jit(lambda x, s: x * s, mesh=MESH)
     .lower(X, 2.0)(X, 3.0), ["Argument s is float 3.0", "lowered for the static value 2.0", "lower anew"]),
    ("Lowered.__call__.**kwargs", "an unknown keyword", lambda: lowered()(X, W, lr=1),
     ["'lr'", "unknown keyword argument", r"parameters are \['x', 'w'\]"]),
]

VALUE_NAMES = [   # naming a value of a Lowered
    ("Lowered.explain.ref", "an unknown name", lambda: lowered().explain("w2"),
     ["'w2'", "No value named", r"name a parameter or result by its path \(x, w"]),
    ("Lowered.explain.ref", "an output index out of range", lambda: lowered().explain(3),
     ["Output index 3", "out of range", "name a value instead"]),
    ("Lowered.explain.ref", "None", lambda: lowered().explain(None),
     ["got None;", "output index .* pytree path or %name", "e.g. 'x' or 0"]),
    ("Lowered.explain.ref", "a bool", lambda: lowered().explain(True),
     ["bool True", "named by output index", "e.g. 'x'"]),
    ("Lowered.sharding_of.ref", "a float", lambda: lowered().sharding_of(1.5),
     ["float 1.5", "named by output index", "e.g. 'x' or 0"]),
    ("Lowered.value.ref", "a list", lambda: lowered().value(["x"]),
     [r"\['x'\]", "named by output index", "e.g. 'x'"]),
    ("Lowered.label.ref", "a dict", lambda: lowered().label({}),
     [r"dict \{\}", "named by output index", "e.g. 'x'"]),
    ("Lowered.describe.sharding", "a value's name", lambda: lowered().describe("x"),
     ["the string 'x'", "needs a gspmd.Sharding", r"describe\(sharding_of\(value\)\)"]),
    ("visualize.which", "a float", lambda: gspmd.visualize(lowered(), 0.5, show=False),
     ["float 0.5", "named by output index", "e.g. 'x'"]),
    ("visualize.which", "given with a jax.Array", lambda: gspmd.visualize(jnp.ones(4), 0, show=False),
     ["visualize\\(array, which\\)", "names a value of a Lowered", "leave it out"]),
    ("visualize.target", "a 4-D value", lambda: gspmd.visualize(
        gspmd.jit(lambda a: gspmd.mesh_split(a, MESH, ["data"] + [None] * 3) + 1).lower(np.ones((2,) * 4, np.float32)),
        show=False),
     ["result float32\\[2,2,2,2\\]", "rank 4", "reshaped or sliced value"]),
    ("visualize.target", "a NumPy array", lambda: gspmd.visualize(X, show=False),
     ["ndarray", "draws a jax.Array or a value of a Lowered", r"step.lower\(\*args\), 'result\[0\]'"]),
    ("visualize.png", "an int", lambda: gspmd.visualize(lowered(), png=3, show=False),
     ["int 3", "needs a file path", "png='layout.png'"]),
    ("visualize.show", "a string", lambda: gspmd.visualize(lowered(), show="no"),
     ["the string 'no'", "visualize\\(show=...\\)", "needs True or False"]),
    ("Lowered.report.hardware", "unknown", lambda: lowered().report(hardware="tpu-v9"),
     ["'tpu-v9'", "Unknown hardware", "choose one of"]),
    ("Lowered.report.hardware", "a number", lambda: lowered().report(hardware=3),
     ["Unknown hardware 3", "choose one of", "gspmd.Hardware"]),
    ("Lowered.report.hardware", "estimates without one", lambda: lowered().report().step_seconds,
     ["Estimates", "need a hardware profile", "report\\(hardware='tpu-v3'\\)"]),
    ("Lowered.compile.compiler_options", "on the sim backend", lambda: lowered().compile({"xla_foo": 1}),
     [r"\['xla_foo'\]", "sim backend compiles nothing", "backend='jax'"]),
    ("Lowered.compile.compiler_options", "a list", lambda: gspmd.jit(mlp, mesh=MESH, backend="jax").lower(
        X, W).compile(["xla_foo"]), ["list \\['xla_foo'\\]", r"compile\(compiler_options=...\) takes a dict"]),
]

MANUAL = [
    ("manual.fn", "not a function", lambda: manual(fn=3),
     ["int 3", "needs a function", "def or lambda"]),
    ("manual.fn", "taking fewer arguments than in_specs", lambda: manual(in_specs=(["data", None], ["data", None])),
     [r"<lambda>\(a\)", "called with 2 positional arguments", "one argument per entry of in_specs"]),
    ("manual.in_specs", "a string", lambda: manual(in_specs="data"),
     ["the string 'data'", "one dims_mapping per argument", r"in_specs=\[\['data', None\]\]"]),
    ("manual.in_specs", "None", lambda: manual(in_specs=None),
     ["got None;", "one dims_mapping per argument", "for one argument"]),
    ("manual.in_specs", "a spec of the wrong rank", lambda: manual(in_specs=(["data"],)),
     [r"argument 0 of gspmd.manual \(shape \(8, 16\)\)", "has 1 entries but .* rank 2", "one entry per tensor dim"]),
    ("manual.in_specs", "an unknown axis", lambda: manual(in_specs=(["dta", None],)),
     [r"entry 'dta' in the spec \['dta', None\] of argument 0", "Unknown mesh axis 'dta'", "has axes"]),
    ("manual.in_specs", "an axis twice", lambda: manual(in_specs=(["data", "data"],)),
     [r"\['data', 'data'\] of argument 0", "more than once", "at most one dim"]),
    ("manual.in_specs", "a non-manual axis", lambda: manual(in_specs=(["model", None],), manual_axes=("data",)),
     [r"\['model', None\] of argument 0", "not manual", "add it to manual_axes"]),
    ("manual.in_specs", "a dim that does not divide", lambda: manual(args=(np.ones((3, 16), np.float32),)),
     [r"shape \(3, 16\)", "does not divide into 2 parts", "pad it"]),
    ("manual.out_specs", "a string", lambda: manual(out_specs="data"),
     ["'data'", "result 0 of gspmd.manual is a string", r"\['data', None\]"]),
    ("manual.out_specs", "None", lambda: manual(out_specs=None),
     ["None", "of type NoneType", "or a PartitionSpec"]),
    ("manual.out_specs", "a spec of the wrong rank", lambda: manual(out_specs=["data"]),
     [r"out_specs\[0\] has 1 entries", r"rank 2 \(per partition float32\[4,16\]\)", "one entry per dim"]),
    ("manual.out_specs", "one spec too many", lambda: manual(out_specs=(["data", None], ["data", None])),
     ["fn returns 1 values", "but 2 out_specs", "out_specs"]),
    ("manual.manual_axes", "one string", lambda: manual(manual_axes="data"),
     ["the string 'data'", "tuple of mesh axis names", r"manual_axes=\('data',\)"]),
    ("manual.manual_axes", "an int", lambda: manual(manual_axes=3),
     ["int 3", "tuple of mesh axis names", r"manual_axes=\('data',\)"]),
    ("manual.manual_axes", "an unknown axis", lambda: manual(manual_axes=("dta",)),
     [r"manual_axes=\('dta',\)", "Unknown mesh axis 'dta'", r"axes \('data', 'model'\)"]),
    ("manual.manual_axes", "an axis twice", lambda: manual(manual_axes=("data", "data")),
     [r"\('data', 'data'\)", "more than once", "each manual axis once"]),
]

PIPELINES = [
    ("pipeline.schedule", "misspelt", lambda: pipeline(schedule="1F1B"),
     ["'1F1B'", "Unknown pipeline schedule", r"choose one of \('gpipe', 'circular', '1f1b'\)"]),
    ("pipeline.schedule", "a list", lambda: pipeline(schedule=["gpipe"]),
     [r"\['gpipe'\]", "Unknown pipeline schedule", "choose one of"]),
    ("pipeline.stage_fn", "not a function", lambda: pipeline(stage_fn=3),
     ["int 3", "needs a function", "def or lambda"]),
    ("pipeline.stage_fn", "taking one argument", lambda: pipeline(stage_fn=lambda x: x),
     [r"<lambda>\(x\)", "called with 2 positional arguments", r"\(params_i, x\)"]),
    ("pipeline.stage_fn", "changing the shape", lambda: pipeline(stage_fn=lambda p, x: x[:2]),
     [r"microbatch of shape \(3,\)", r"to shape \(2,\)", "must return a value of its input's shape"]),
    ("pipeline.repeats", "a string", lambda: pipeline(repeats="2", schedule="circular"),
     ["the string '2'", "whole number >= 1", "repeats"]),
    ("pipeline.repeats", "zero", lambda: pipeline(repeats=0, schedule="circular"),
     ["int 0", "whole number >= 1", "pass e.g. 2"]),
    ("pipeline.repeats", "more than one with gpipe", lambda: pipeline(repeats=2),
     ["repeats=2", "runs each layer once", "schedule='circular'"]),
    ("pipeline.stage_major", "a string", lambda: pipeline(stage_major="yes"),
     ["the string 'yes'", "stage_major=", "True or False"]),
    ("pipeline.manual_stages", "a string", lambda: pipeline(manual_stages="yes"),
     ["the string 'yes'", "manual_stages=", "True or False"]),
    ("pipeline.scan_layers", "a string", lambda: pipeline(scan_layers="yes"),
     ["the string 'yes'", "scan_layers=", "True or False"]),
    ("pipeline.scan_layers", "with layers of different counts", lambda: pipeline(
        stacked_params={"a": np.ones((2, 3, 3), np.float32), "b": np.ones((2, 2, 3), np.float32)}, scan_layers=True),
     [r"scan_layers=True", r"\[layers, K, \.\.\.\] with one K", r"second dims \[\(2,\), \(3,\)\]"]),
    ("pipeline.key", "a batch of keys", lambda: pipeline(key=jax.random.split(jax.random.key(0))),
     [r"pipeline\(key=\.\.\.\) needs one PRNG key", r"keys of shape \(2,\)", "folded in"]),
    ("pipeline.key", "with a stage_fn that does not take it", lambda: pipeline(key=jax.random.key(0)),
     [r"stage_fn \(it gets \(params_i, x, key\)\)", "called with 3 positional arguments",
      "give it 3 parameters"]),
    ("pipeline_loss.key", "raw uint32 key data", lambda: pipeline_loss(key=np.array([0, 1], np.uint32)),
     [r"pipeline_loss\(key=\.\.\.\)", r"array\(\[0, 1\], dtype=uint32\)", "jax.random.wrap_key_data"]),
    ("pipeline.scatter_axis", "the stage axis", lambda: pipeline(scatter_axis="p"),
     ["scatter_axis='p'", "other than the stage axis 'p'", "replicated over"]),
    ("pipeline_loss.scatter_axis", "not an axis of the mesh", lambda: pipeline_loss(scatter_axis="tensor"),
     ["scatter_axis='tensor'", "needs an axis of", "tensor parallelism's"]),
    ("pipeline.remat", "a string", lambda: pipeline(remat="dots"),
     ["the string 'dots'", "True, False or a jax.checkpoint policy", "dots_saveable"]),
    ("pipeline.stacked_params", "one layer short", lambda: pipeline(stacked_params=np.ones((3, 3), np.float32)),
     [r"shape \(3, 3\)", "must have a leading layer dim", "2 stages x 1 repeats"]),
    ("pipeline_loss.loss_fn", "not a function", lambda: pipeline_loss(loss_fn=3),
     ["int 3", "needs a function", r"loss_fn \(it gets \(ys\[m\], targets\[m\]\)\)"]),
    ("pipeline_loss.loss_fn", "taking one argument", lambda: pipeline_loss(loss_fn=lambda y: y),
     [r"<lambda>\(y\)", "called with 2 positional arguments", "give it 2 parameters"]),
    ("pipeline_loss.ends", "with a loss_fn that does not take them", lambda: pipeline_loss(ends=np.ones(3)),
     [r"loss_fn \(it gets \(ys\[m\], targets\[m\], ends\)\)", "called with 3 positional arguments",
      "give it 3 parameters"]),
    ("pipeline_loss.first_fn", "without ends", lambda: pipeline_loss(first_fn=lambda ends, x: x),
     ["first_fn=", "pass them as ends=", r"first_fn\(ends, microbatch\)"]),
    ("pipeline_loss.first_fn", "not a function", lambda: pipeline_loss(
        first_fn="embed", ends=np.ones(3), loss_fn=lambda y, t, e: jnp.sum(y)),
     ["the string 'embed'", "needs a function", r"first_fn=\.\.\.\) \(it gets \(ends, microbatches\[m\]\)\)"]),
    ("pipeline_loss.stage_fn", "not a function", lambda: gspmd.pipeline_loss(
        "stage", lambda y, t: y, STACKED, MICROBATCHES, MICROBATCHES, mesh=PIPE_MESH, stage_axis="p"),
     ["the string 'stage'", "needs a function", "def or lambda"]),
    ("pipeline_loss.schedule", "misspelt", lambda: pipeline_loss(schedule="1F1B"),
     ["'1F1B'", "Unknown pipeline schedule", "choose one of"]),
    ("pipeline_loss.repeats", "zero", lambda: pipeline_loss(repeats=0),
     ["int 0", "whole number >= 1", "repeats"]),
    ("pipeline_loss.stage_major", "a number", lambda: pipeline_loss(stage_major=2),
     ["int 2", "stage_major=", "True or False"]),
    ("pipeline_loss.remat", "False with 1F1B", lambda: pipeline_loss(remat=False),
     ["remat=False", "always recompute each stage", "schedule='gpipe' or 'circular'"]),
    ("pipeline_loss.remat", "a string", lambda: pipeline_loss(schedule="gpipe", remat="dots"),
     [r"gspmd\.pipeline_loss\(remat=", "the string 'dots'", "True, False or a jax.checkpoint policy"]),
    ("pipeline_loss.scan_layers", "a stack with no layer dim to scan", lambda: gspmd.pipeline_loss(
        stage, lambda y, t: y, np.ones((2,), np.float32), MICROBATCHES, MICROBATCHES, mesh=PIPE_MESH, stage_axis="p",
        scan_layers=True),
     [r"scan_layers=True", "with one K", r"second dims \[\(\)\]"]),
    ("pipeline_loss.manual_stages", "None", lambda: pipeline_loss(manual_stages=None),
     ["None", "manual_stages=", "True or False"]),
    ("stage_major_order.stages", "zero", lambda: gspmd.stage_major_order(np.ones((4, 3)), 0, 2),
     ["stages=", "whole number >= 1", "int 0"]),
    ("stage_major_order.repeats", "a string", lambda: gspmd.stage_major_order(np.ones((4, 3)), 2, "2"),
     ["the string '2'", "whole number >= 1", "repeats="]),
]

AUTO = [   # gspmd.auto's options (they fail before any search)
    ("auto.fn", "not a function", lambda: gspmd.auto(3, X),
     ["int 3", "needs a function", "def or lambda"]),
    ("auto.fn", "taking fewer arguments than given", lambda: gspmd.auto(lambda x: x, X, W),
     [r"<lambda>\(x\)", "called with 2 positional arguments", "give it 2 parameters"]),
    ("auto.devices", "a string", lambda: gspmd.auto(matmul, X, W, devices="8"),
     ["the string '8'", "whole number >= 1", "device count"]),
    ("auto.devices", "zero", lambda: gspmd.auto(matmul, X, W, devices=0),
     ["int 0", "whole number >= 1", "device count"]),
    ("auto.hardware", "unknown", lambda: gspmd.auto(matmul, X, W, hardware="tpu9"),
     ["'tpu9'", "Unknown hardware", "choose one of"]),
    ("auto.memory_limit", "a string", lambda: gspmd.auto(matmul, X, W, memory_limit="1G"),
     ["the string '1G'", "whole number >= 1", "bytes per device"]),
    ("auto.memory_limit", "negative", lambda: gspmd.auto(matmul, X, W, memory_limit=-5),
     ["int -5", "whole number >= 1", "bytes per device"]),
    ("auto.fixed", "a list", lambda: gspmd.auto(matmul, X, W, fixed=["x"]),
     [r"\['x'\]", "needs a dict from parameter path to dims_mapping", r"fixed=\{'x': \['x', None\]\}"]),
    ("auto.fixed", "an unknown path", lambda: gspmd.auto(matmul, X, W, devices=2, fixed={"q": ["x", None]}),
     ["'q'", "not a parameter", "parameters are x, w"]),
    ("auto.fixed", "a string spec", lambda: gspmd.auto(matmul, X, W, devices=2, fixed={"x": "x"}),
     [r"fixed\['x'\] \(shape \(8, 16\)\)", "is a string", r"\['x', None\]"]),
    ("auto.fixed", "an int spec", lambda: gspmd.auto(matmul, X, W, devices=2, fixed={"x": 3}),
     [r"fixed\['x'\]", "of type int, not a sequence", r"\['x', None\]"]),
    ("auto.progress", "a string", lambda: gspmd.auto(matmul, X, W, progress="x"),
     ["the string 'x'", "needs a function", r"\(done, total, what\)"]),
    ("auto.effort", "a string", lambda: gspmd.auto(matmul, X, W, effort="high"),
     ["the string 'high'", "needs a gspmd.autoshard.search.Effort", r"Effort\(beam=64\)"]),
    ("auto.verify", "a string", lambda: gspmd.auto(matmul, X, W, verify="3"),
     ["the string '3'", "whole number >= 1", "candidates partitioned for real"]),
    ("auto.verify", "negative", lambda: gspmd.auto(matmul, X, W, verify=-1, effort=Effort()),
     ["int -1", "whole number >= 1", "verify="]),
]

HARDWARE = [
    ("Hardware.name", "empty", lambda: hardware(name=""),
     ["got the string ''", "needs a non-empty string", "Hardware\\(name=...\\)"]),
    ("Hardware.flops_per_s", "a string", lambda: hardware(flops_per_s="fast"),
     ["the string 'fast'", "needs a number > 0", "flops_per_s"]),
    ("Hardware.hbm_bytes_per_s", "zero", lambda: hardware(hbm_bytes_per_s=0),
     ["int 0", "needs a number > 0", "hbm_bytes_per_s"]),
    ("Hardware.memory_bytes", "a float", lambda: hardware(memory_bytes=16e9),
     ["float 16000000000.0", "whole number >= 1", r"memory_bytes=16 \* 2\*\*30"]),
    ("Hardware.interconnect", "None", lambda: hardware(interconnect=None),
     ["got None;", "needs a Torus or Hosts", r"Hosts\(8, 450e9"]),
    ("Hardware.matmul_efficiency", "a percentage", lambda: hardware(matmul_efficiency=80),
     ["int 80", "needs a number > 0 and <= 1", "matmul_efficiency"]),
    ("Hardware.memory_efficiency", "zero", lambda: hardware(memory_efficiency=0),
     ["int 0", "needs a number > 0 and <= 1", "memory_efficiency"]),
    ("Hardware.vector_ops_per_s", "a string", lambda: hardware(vector_ops_per_s="fast"),
     ["the string 'fast'", "vector_ops_per_s"]),
    ("Hardware.collective_overhead_s", "negative", lambda: hardware(collective_overhead_s=-1e-6),
     ["-1e-06", "needs a number >= 0", "collective_overhead_s"]),
    ("Hardware.overlap", "above one", lambda: hardware(overlap=1.5),
     ["float 1.5", "needs a number >= 0 and <= 1", "overlap"]),
    ("Hardware.kernel_scratch", "a string", lambda: hardware(kernel_scratch="no"),
     ["the string 'no'", "needs True or False", "kernel_scratch"]),
    ("Hardware.rematerializes", "None", lambda: hardware(rematerializes=None),
     ["None", "needs True or False", "rematerializes"]),
    ("Hardware.fuses_into_matmul", "a number", lambda: hardware(fuses_into_matmul=0),
     ["int 0", "needs True or False", "fuses_into_matmul"]),
    ("Hardware.reserved_bytes", "negative", lambda: hardware(reserved_bytes=-1),
     ["int -1", "whole number >= 0", "reserved_bytes"]),
]

FAMILIES = {"dims_mapping": DIMS_MAPPING, "arrays": ARRAYS, "meshes": MESHES, "tile assignments": TILE_ASSIGNMENTS,
            "positions": POSITIONS, "jit options": JIT_OPTIONS, "layouts": LAYOUTS, "calls": CALLS,
            "value names": VALUE_NAMES, "manual": MANUAL, "pipelines": PIPELINES, "auto": AUTO,
            "hardware": HARDWARE}
MISTAKES = [(f"{family}: {argument}: {name}", mistake, patterns)
            for family, cases in FAMILIES.items() for argument, name, mistake, patterns in cases]

# The public functions and methods whose every argument the corpus must cover.
PUBLIC = {
    "jit": gspmd.jit, "mesh_split": gspmd.mesh_split, "manual": gspmd.manual, "pipeline": gspmd.pipeline,
    "pipeline_loss": gspmd.pipeline_loss, "stage_major_order": gspmd.stage_major_order, "auto": gspmd.auto,
    "visualize": gspmd.visualize, "Mesh": gspmd.Mesh, "Mesh.from_jax": gspmd.Mesh.from_jax,
    "Mesh.axis_index": gspmd.Mesh.axis_index, "Sharding": gspmd.Sharding,
    "Sharding.replicated": gspmd.Sharding.replicated, "Sharding.tiled": gspmd.Sharding.tiled,
    "Sharding.from_mesh": gspmd.Sharding.from_mesh, "Sharding.from_named": gspmd.Sharding.from_named,
    "Sharding.merge": gspmd.Sharding.merge, "Sharding.spec": gspmd.Sharding.spec,
    "Sharding.dims_mapping": gspmd.Sharding.dims_mapping, "Sharding.describe": gspmd.Sharding.describe,
    "Partitioned.__call__": gspmd.Partitioned.__call__, "Partitioned.lower": gspmd.Partitioned.lower,
    "Lowered.__call__": gspmd.Lowered.__call__, "Lowered.report": gspmd.Lowered.report,
    "Lowered.compile": gspmd.Lowered.compile,
    "Lowered.value": gspmd.Lowered.value, "Lowered.sharding_of": gspmd.Lowered.sharding_of,
    "Lowered.explain": gspmd.Lowered.explain, "Lowered.describe": gspmd.Lowered.describe,
    "Lowered.label": gspmd.Lowered.label, "Plan.jit": gspmd.Plan.jit, "Hardware": gspmd.Hardware,
}


@pytest.mark.parametrize("name,mistake,patterns", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_gets_a_clear_error(name, mistake, patterns):
    with pytest.raises(gspmd.ShardingError) as info:
        mistake()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{name}: {pattern!r} not in: {message}"


def _arguments(name: str, fn) -> set[str]:
    """"function.parameter" for each parameter of a public function (*args, **kwargs as written)."""
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    parameters = inspect.signature(fn).parameters.values()
    return {f"{name}.{prefix.get(p.kind, '')}{p.name}" for p in parameters if p.name not in ("self", "cls")}


def test_every_argument_is_covered():
    wanted = set().union(*(_arguments(name, fn) for name, fn in PUBLIC.items()))
    covered = {argument for cases in FAMILIES.values() for argument, *_ in cases}
    assert not wanted - covered, f"arguments without a mistake in the corpus: {sorted(wanted - covered)}"
    assert not covered - wanted, f"cases naming no public argument: {sorted(covered - wanted)}"


def test_the_corpus_is_large():
    assert len(MISTAKES) >= 200


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
    from gspmd.analysis import xla
    gspmd.jit(mlp, mesh=MESH)(X, W)
    with mesh_split_as(xla.xla_constraint):
        jax.jit(mlp)(X, W)
    assert not [w for w in recwarn if issubclass(w.category, gspmd.UnpartitionedWarning)]
