"""How gspmd.jit reads a call's arguments, as jax.jit and eqx.filter_jit do.

Array leaves (NumPy and jax arrays, NumPy scalars, tracers) are the program's
parameters; every other leaf (Python numbers, strings, functions such as an Equinox
module's activation) is static: part of the cache key and passed through unchanged.
`static_argnums`/`static_argnames` make whole arguments static.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from gspmd.errors import ShardingError
from gspmd.mesh import has_explicit_axes, jax_context_mesh
from gspmd.ops.convert import is_key

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.core.Tracer, jax.ShapeDtypeStruct)
try:   # the concrete jax.Array class, looked up by exact type before the isinstance checks
    from jax._src.array import ArrayImpl
    _FAST_ARRAY_TYPES = {np.ndarray, ArrayImpl}
except ImportError:
    _FAST_ARRAY_TYPES = {np.ndarray}
_STATIC = object()   # marks a static leaf in a cache key


def is_array(x) -> bool:
    return type(x) in _FAST_ARRAY_TYPES or isinstance(x, _ARRAY_TYPES)


def leaf_key(x) -> tuple:
    """What a leaf contributes to the cache key: shape, dtype and committed layout, or
    its static value."""
    if type(x) in _FAST_ARRAY_TYPES or isinstance(x, _ARRAY_TYPES):
        return (x.shape, x.dtype, committed_layout(x))
    return (_STATIC, type(x), x)


def committed_layout(x) -> Optional[NamedSharding]:
    """The layout an argument brings with it, which jax.jit keeps: the NamedSharding of
    a committed jax.Array (or of a ShapeDtypeStruct given one) over several devices.
    NumPy arrays and uncommitted or single-device jax.Arrays bring none."""
    if isinstance(x, jax.core.Tracer):
        return _typed_layout(x)
    sharding = getattr(x, "sharding", None)
    if (not isinstance(sharding, NamedSharding) or sharding.num_devices == 1
            or (isinstance(x, jax.Array) and not getattr(x, "_committed", True))):
        return None
    return sharding


def _typed_layout(x: jax.core.Tracer) -> Optional[NamedSharding]:
    """A traced value's layout, where its type holds one (Explicit axes): over the
    concrete mesh jax.set_mesh gives, else over that of the array the tracer holds
    (jax.grad, jvp or vmap of arrays placed over a jax.make_mesh mesh), else over the
    type's abstract mesh, which mesh_split resolves (to gspmd.jit's mesh). Tracing
    without it would mix untyped tracers with the other arguments' typed values, which
    jax's type rules refuse."""
    sharding, mesh = getattr(x.aval, "sharding", None), jax_context_mesh() or _mesh_under(x)
    if not isinstance(sharding, NamedSharding) or not has_explicit_axes(sharding.mesh):
        return None
    if mesh is None:
        return sharding
    return NamedSharding(mesh, sharding.spec) if sharding.mesh == mesh.abstract_mesh else None


def _mesh_under(x: jax.core.Tracer) -> Optional[jax.sharding.Mesh]:
    """The concrete mesh of the array under a tracer of an eager transformation (vmap's
    `val`, jvp's and linearize's `primal`; a staged trace, jax.jit's, holds none), as
    jax.jit, dispatched on those arrays, runs over it."""
    while isinstance(x, jax.core.Tracer):
        x = next((getattr(x, name) for name in ("primal", "val") if hasattr(x, name)), None)
    sharding = getattr(x, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh) \
        else None


def key_layout(key: tuple) -> Optional[NamedSharding]:
    """The committed layout in an array leaf's cache key."""
    return None if is_static_key(key) else key[2]


def is_static_key(key: tuple) -> bool:
    return key[0] is _STATIC


def abstract_argument(x, name: str, committed: Optional[NamedSharding] = None) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an array argument (and over a mesh of Explicit axes, its
    layout, which is part of its type); non-numeric arrays are a mistake."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if not (is_key(dtype) or jax.numpy.issubdtype(dtype, jax.numpy.number) or dtype == np.bool_):
        raise ShardingError(f"Argument {name} is an array of dtype {dtype} (shape {tuple(np.shape(x))}); gspmd.jit "
                            "partitions numeric arrays only: convert it to numbers, or make it static "
                            "(static_argnums) if the function reads it in Python.")
    explicit = committed is not None and has_explicit_axes(committed.mesh)
    if isinstance(x, jax.ShapeDtypeStruct) and (explicit or x.sharding is None):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), dtype if is_key(dtype) else jax.dtypes.canonicalize_dtype(dtype),
                                sharding=committed if explicit else None)


class Signature:
    """The wrapped function's parameters: which arguments are static, which donated,
    and the names reports give them."""

    def __init__(self, fn: Callable, static_argnums: Sequence[int], static_argnames: Sequence[str],
                 donate_argnums: Sequence[int], donate_argnames: Sequence[str] = ()):
        self.name = getattr(fn, "__name__", type(fn).__name__)
        try:
            self.parameters: Optional[dict] = dict(inspect.signature(fn).parameters)
        except (TypeError, ValueError):   # builtins and some callables have none
            self.parameters = None
        self.static_argnums = _ints(static_argnums, "static_argnums")
        self.static_argnames = _names(static_argnames, "static_argnames")
        self.donate_argnums = _ints(donate_argnums, "donate_argnums")
        self.donate_argnames = _names(donate_argnames, "donate_argnames")
        positional = self._positional_names()
        self._check_positions(self.static_argnums, "static_argnums", len(positional))
        self._check_positions(self.donate_argnums, "donate_argnums", len(positional))
        for name in self.static_argnames:
            self._check_name(name, "static_argnames")
            if name in positional:   # also static when passed by position (as jax.jit)
                self.static_argnums += (positional.index(name),)
        for name in self.donate_argnames:
            self._check_name(name, "donate_argnames")
            if name in positional:   # also donated when passed by position (as jax.jit)
                self.donate_argnums += (positional.index(name),)
        self.donate_argnames += tuple(positional[i] for i in self.donate_argnums
                                      if 0 <= i < len(positional) and positional[i] not in self.donate_argnames)
        self.static_argnames += tuple(positional[i] for i in self.static_argnums
                                      if 0 <= i < len(positional) and positional[i] not in self.static_argnames)
        both = sorted(set(self.static_argnames) & set(self.donate_argnames))
        if both:
            raise ShardingError(f"Argument {both[0]!r} of {self.name} is both static and donated: a static argument "
                                "is a Python value that keys the cache, not a buffer to reuse; drop it from "
                                "static_argnums/static_argnames or from donate_argnums/donate_argnames.")
        self.simple = not self.static_argnums and not self.static_argnames

    def _check_positions(self, nums: tuple[int, ...], what: str, n: int) -> None:
        """Positions must exist (as jax.jit checks) where the function says how many it takes."""
        if self.parameters is None or any(p.kind is inspect.Parameter.VAR_POSITIONAL
                                          for p in self.parameters.values()):
            return
        wrong = [i for i in nums if not -n <= i < n]
        if wrong:
            raise ShardingError(f"{what}={nums} names argument position {wrong[0]}, but {self.name}"
                                f"{self._parameter_list()} takes {n} positional argument{'s' * (n != 1)}: use "
                                f"0..{n - 1} (or -{n}..-1), or name the argument in {what[:-4]}names.")

    def _check_name(self, name: str, what: str) -> None:
        if self.parameters is not None and name not in self.parameters and not self._takes_var_keywords():
            raise ShardingError(f"{what} names {name!r}, which is not a parameter of {self.name}"
                                f"{self._parameter_list()}; {_suggest(name, self.parameters)}")

    def _positional_names(self) -> list[str]:
        if self.parameters is None:
            return []
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [n for n, p in self.parameters.items() if p.kind in kinds]

    def _takes_var_keywords(self) -> bool:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in self.parameters.values())

    def _parameter_list(self) -> str:
        return f"({', '.join(self.parameters)})" if self.parameters is not None else ""

    # -- per call ---------------------------------------------------------------------
    def split_static(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """(dynamic args, dynamic kwargs, static part of the key)."""
        if self.simple:
            return args, kwargs, ()
        nums = self.static_positions(len(args))
        static = tuple((i, args[i]) for i in sorted(nums)) + tuple(
            (k, kwargs[k]) for k in sorted(kwargs) if k in self.static_argnames)
        args = tuple(a for i, a in enumerate(args) if i not in nums)
        kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return args, kwargs, static

    def static_positions(self, n: int) -> set[int]:
        """The static ones among n positional arguments."""
        return {i % n for i in self.static_argnums if -n <= i < n}

    def check_call(self, args: tuple, kwargs: dict) -> None:
        """A ShardingError for a call the function cannot take (unknown keyword, wrong
        number of arguments), said in its parameters' names."""
        if self.parameters is None:
            return
        try:
            inspect.Signature(list(self.parameters.values())).bind(*args, **kwargs)
        except TypeError as e:
            unknown = [k for k in kwargs if k not in self.parameters]
            if unknown and not self._takes_var_keywords():
                raise ShardingError(
                    f"{self.name}{self._parameter_list()} got an unknown keyword argument {unknown[0]!r}; "
                    f"{_suggest(unknown[0], self.parameters)}") from None
            raise ShardingError(f"{self.name}{self._parameter_list()} cannot take these arguments: {e}.") from None

    def rebuild(self, static: tuple, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's full arguments from its dynamic ones and the static part."""
        args, kwargs = list(args), dict(kwargs)
        for where, value in static:
            if isinstance(where, int):
                args.insert(where, value)
            else:
                kwargs[where] = value
        return tuple(args), kwargs

    def arg_name(self, i: int) -> str:
        """The name of positional argument i (args[i] past a *args)."""
        names = self._positional_names()
        return names[i] if i < len(names) else f"args[{i}]"

    def donated_leaves(self, args: tuple, kwargs: dict, static: tuple) -> tuple[int, ...]:
        """Indices among the flat dynamic leaves (of (args, kwargs), as tree_flatten
        orders them) of the donated arguments, given by position or by name."""
        if not self.donate_argnums and not self.donate_argnames:
            return ()
        full, _ = self.rebuild(static, args, {})
        n = len(full)
        donated = {i % n for i in self.donate_argnums if -n <= i < n}
        static_nums = {w for w, _ in static if isinstance(w, int)}
        flags = [i in donated for i, a in enumerate(full) if i not in static_nums for x in jax.tree_util.tree_leaves(a)
                 if is_array(x)]
        flags += [k in self.donate_argnames for k in sorted(kwargs) for x in jax.tree_util.tree_leaves(kwargs[k])
                  if is_array(x)]
        return tuple(i for i, flag in enumerate(flags) if flag)


@dataclass(frozen=True)
class Template:
    """One cache entry's call shape: rebuilds the full call from the dynamic leaves."""
    treedef: Any
    keys: tuple           # leaf_key of every leaf
    static: tuple         # static whole arguments
    dynamic: Optional[tuple[int, ...]]   # positions of the array leaves (None: all)

    @classmethod
    def of(cls, treedef, keys: tuple, static: tuple) -> "Template":
        dynamic = tuple(i for i, k in enumerate(keys) if not is_static_key(k))
        return cls(treedef, keys, static, None if len(dynamic) == len(keys) else dynamic)

    def dynamic_leaves(self, leaves: list) -> list:
        return leaves if self.dynamic is None else [leaves[i] for i in self.dynamic]

    def leaves(self, dynamic: Sequence) -> list:
        if self.dynamic is None:
            return list(dynamic)
        out = [k[2] if is_static_key(k) else None for k in self.keys]
        for i, x in zip(self.dynamic, dynamic):
            out[i] = x
        return out


def paths(signature: Signature, args: tuple, kwargs: dict, static: tuple) -> list[str]:
    """The user's name for each leaf of the dynamic (args, kwargs): params['layer0']['w1']."""
    static_nums = sorted(w for w, _ in static if isinstance(w, int))
    positions = [i for i in range(len(args) + len(static_nums)) if i not in static_nums]
    named = [(signature.arg_name(i), a) for i, a in zip(positions, args)] + sorted(kwargs.items())   # as tree_flatten
    return [name + jax.tree_util.keystr(p) for name, tree in named
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def result_paths(out_tree) -> list[str]:
    """result, result[0], result['loss'], ...: the user's name for each output leaf."""
    tree = _placeholders(out_tree)
    if tree is None:
        return [f"result[{i}]" for i in range(out_tree.num_leaves)]
    return ["result" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def result_logical_axes(out_tree) -> list[Optional[tuple]]:
    """logical_axes of the function's results (flax variables it returns keep their metadata)."""
    tree = _placeholders(out_tree)
    return [None] * out_tree.num_leaves if tree is None else logical_axes(tree)


def _placeholders(out_tree):
    try:
        return jax.tree_util.tree_unflatten(out_tree, [0] * out_tree.num_leaves)
    except Exception:   # a custom pytree that cannot be rebuilt from placeholders
        return None


# Where flax keeps a variable's logical axis names: nnx metadata (out_sharding since flax
# 0.12, sharding_names and sharding before); linen's LogicallyPartitioned box: names.
_LOGICAL_METADATA = ("out_sharding", "sharding_names", "sharding")


def logical_axes(tree) -> list[Optional[tuple]]:
    """Per leaf of `tree` (tree_flatten order): the logical axis names (MaxText's embed,
    mlp, heads, ...) that the flax variable holding it declares, or None."""
    out = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: _declared_axes(x) is not None):
        out += [_declared_axes(node)] * len(jax.tree_util.tree_leaves(node))
    return out


def _declared_axes(node) -> Optional[tuple]:
    if not type(node).__module__.startswith("flax."):   # (other pytrees' methods of these names mean other things)
        return None
    get_metadata = getattr(node, "get_metadata", None)
    metadata = get_metadata() if callable(get_metadata) else {}
    candidates = [metadata.get(key) for key in _LOGICAL_METADATA] if isinstance(metadata, dict) else []
    if hasattr(node, "unbox") and hasattr(node, "rules"):   # linen's LogicallyPartitioned
        candidates.append(getattr(node, "names", None))
    for names in candidates:
        if (isinstance(names, (tuple, list)) and any(isinstance(n, str) for n in names)
                and all(n is None or isinstance(n, str) for n in names)):
            return tuple(names)
    return None


def _ints(values, what: str) -> tuple[int, ...]:
    """Argument positions: an int, a sequence of ints, or None (none), as jax.jit takes them."""
    for v in _entries(values):
        if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
            raise ShardingError(f"{what} must be ints (argument positions), got {v!r}; pass e.g. {what}=(1,).")
    return tuple(int(v) for v in _entries(values))


def _names(values, what: str) -> tuple[str, ...]:
    """Parameter names: a string, a sequence of strings, or None (none), as jax.jit takes them."""
    for v in _entries(values):
        if not isinstance(v, str):
            raise ShardingError(f"{what} must be strings (parameter names), got {v!r}; pass e.g. {what}=('w',).")
    return _entries(values)


def _entries(values) -> tuple:
    if values is None:
        return ()
    return tuple(values) if isinstance(values, (list, tuple, set, frozenset)) else (values,)


def _suggest(name: str, parameters: Optional[dict]) -> str:
    close = difflib.get_close_matches(name, list(parameters or ()), n=1)
    known = f"its parameters are {list(parameters)}" if parameters else "it takes no keywords"
    return f"did you mean {close[0]!r}?" if close else f"{known}."
