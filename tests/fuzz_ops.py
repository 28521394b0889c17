"""The op pool of the differential fuzzer (tests/fuzz_programs.py): one small maker per op
family. A maker takes a Draw and the abstract value a program has so far and returns
(fn, params): fn(x, *params) applies the op, params are the NumPy arrays it takes as
program inputs (weights, indices, a trip count, a seed), which annotations may split too.
A maker returns None where its op does not apply to the value (rank, sizes)."""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Built = Optional[tuple[Callable, list]]


class Draw:
    """Seeded random choices; a program is rebuilt from the same seeds exactly."""

    def __init__(self, seed: int):
        self.rng = np.random.RandomState(seed % (2 ** 32))

    def int(self, lo: int, hi: int) -> int:
        """Uniform in [lo, hi] (both included)."""
        return int(self.rng.randint(lo, hi + 1))

    def pick(self, options):
        return options[self.rng.randint(len(options))]

    def coin(self, p: float = 0.5) -> bool:
        return bool(self.rng.rand() < p)

    def axis(self, rank: int) -> int:
        return self.int(0, rank - 1)

    def normal(self, shape, dtype, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(dtype)

    def ints(self, shape, lo: int, hi: int) -> np.ndarray:
        return self.rng.randint(lo, hi + 1, size=shape).astype(np.int32)


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype)


# -- element-wise ------------------------------------------------------------------------
UNARY = [jnp.tanh, jnp.sin, jax.nn.sigmoid, jax.nn.relu, jnp.abs, jax.nn.softplus, jax.nn.gelu,
         lambda v: jnp.log1p(jnp.abs(v)), jnp.square, jnp.negative, jnp.cos, lambda v: jnp.exp(jnp.tanh(v)),
         jax.nn.silu, lambda v: lax.rsqrt(1 + v * v)]


def unary(r: Draw, x) -> Built:
    f = r.pick(UNARY)
    return (lambda v: f(v)), []


def binary(r: Draw, x) -> Built:
    """x op p, p broadcast: its leading dims dropped, some dims of size 1."""
    shape = [1 if r.coin(0.3) else d for d in x.shape[r.int(0, x.ndim):]]
    op = r.pick([jnp.add, jnp.subtract, jnp.multiply, jnp.maximum, jnp.minimum])
    flip = r.coin()
    return (lambda v, p: op(p, v) if flip else op(v, p)), [r.normal(shape, _dtype(x))]


def select(r: Draw, x) -> Built:
    shape = [1 if r.coin(0.4) else d for d in x.shape]
    return (lambda v, p: jnp.where(p > 0, v, 0.5 * p - v)), [r.normal(shape, _dtype(x))]


def clip(r: Draw, x) -> Built:
    lo = float(r.rng.uniform(-1.5, 0))
    return (lambda v: jnp.clip(v, lo, lo + 1.5) + lax.integer_pow(v, 2) * 0.1), []


def convert(r: Draw, x) -> Built:
    """A round trip through another type (a convert the partitioner must keep where it is)."""
    other = r.pick([jnp.bfloat16, jnp.float16, jnp.float32])
    return (lambda v: v.astype(other).astype(v.dtype) * 2), []


def iota_mask(r: Draw, x) -> Built:
    """Partition-dependent offsets: a triangular mask from two iotas."""
    if x.ndim < 2:
        return None
    a, b = r.pick([(i, j) for i in range(x.ndim) for j in range(x.ndim) if i != j])
    return (lambda v: jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, a)
                                >= lax.broadcasted_iota(jnp.int32, v.shape, b), v, -v)), []


# -- dot / einsum -----------------------------------------------------------------------
def matmul(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    k, n = x.shape[-1], r.pick([1, 2, 3, 4, 5, 8])
    return (lambda v, w: v @ w), [r.normal((k, n), _dtype(x), 1 / np.sqrt(k))]


def tensordot(r: Draw, x) -> Built:
    """Contract a dim other than the last; the new dim goes last."""
    if x.ndim == 0:
        return None
    axis, n = r.axis(x.ndim), r.pick([1, 3, 4, 6])
    w = r.normal((x.shape[axis], n), _dtype(x), 1 / np.sqrt(x.shape[axis]))
    return (lambda v, w: jnp.tensordot(v, w, axes=([axis], [0]))), [w]


def batched_einsum(r: Draw, x) -> Built:
    if x.ndim == 3:
        n = r.pick([2, 3, 4])
        w = r.normal((x.shape[0], x.shape[2], n), _dtype(x), 0.5)
        return (lambda v, w: jnp.einsum("abc,acd->abd", v, w)), [w]
    if x.ndim == 2:
        n = r.pick([1, 2, 5])
        w = r.normal((n, x.shape[1]), _dtype(x), 0.5)
        return (lambda v, w: jnp.einsum("ab,cb->ca", v, w)), [w]
    return None


def outer(r: Draw, x) -> Built:
    if x.ndim > 2:
        return None
    u = r.normal((r.pick([1, 2, 3, 4]),), _dtype(x))
    return (lambda v, u: v[..., None] * u), [u]


def self_dot(r: Draw, x) -> Built:
    """x^T x style: both operands the same value (one reshard serving both)."""
    if x.ndim < 2:
        return None
    return (lambda v: jnp.einsum("...ij,...ik->...jk", v, v) / v.shape[-2]), []


# -- reductions ---------------------------------------------------------------------------
def reduce(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axes = tuple(sorted({r.axis(x.ndim) for _ in range(r.int(1, 2))}))
    f, keep = r.pick([jnp.sum, jnp.max, jnp.min, jnp.mean]), r.coin()
    return (lambda v: f(v, axis=axes, keepdims=keep)), []


def softmax(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis, log = r.axis(x.ndim), r.coin(0.3)
    return (lambda v: (jax.nn.log_softmax if log else jax.nn.softmax)(v, axis=axis)), []


def logsumexp(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    return (lambda v: jax.nn.logsumexp(v, axis=axis, keepdims=True) - v), []


def layer_norm(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    n, dt = x.shape[-1], _dtype(x)
    return (lambda v, g, b: (v - v.mean(-1, keepdims=True)) * lax.rsqrt(v.var(-1, keepdims=True) + 0.5) * g + b,
            [r.normal((n,), dt), r.normal((n,), dt)])


def argmax(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis, f = r.axis(x.ndim), r.pick([jnp.argmax, jnp.argmin])
    return (lambda v: v + f(v, axis=axis, keepdims=True).astype(v.dtype)), []


# -- shapes --------------------------------------------------------------------------------
def _factor(r: Draw, n: int) -> list[int]:
    """A random shape of n elements, rank 1 to 3."""
    dims = []
    for _ in range(r.int(0, 2)):
        divisors = [d for d in range(2, n + 1) if n % d == 0]
        if not divisors:
            break
        d = r.pick(divisors)
        dims.append(d)
        n //= d
    return dims + [n] if n > 1 or not dims else dims


def reshape(r: Draw, x) -> Built:
    shape = tuple(_factor(r, int(np.prod(x.shape))))
    return (lambda v: v.reshape(shape)), []


def merge_or_split(r: Draw, x) -> Built:
    """Merge two adjacent dims, or split one into two factors."""
    if x.ndim >= 2 and r.coin():
        i = r.int(0, x.ndim - 2)
        shape = x.shape[:i] + (x.shape[i] * x.shape[i + 1],) + x.shape[i + 2:]
    else:
        splittable = [i for i, d in enumerate(x.shape) if any(d % f == 0 for f in range(2, d))]
        if not splittable:
            return None
        i = r.pick(splittable)
        f = r.pick([f for f in range(2, x.shape[i]) if x.shape[i] % f == 0])
        shape = x.shape[:i] + (f, x.shape[i] // f) + x.shape[i + 1:]
    return (lambda v: v.reshape(shape)), []


def transpose(r: Draw, x) -> Built:
    perm = tuple(int(p) for p in r.rng.permutation(x.ndim))
    return (lambda v: jnp.transpose(v, perm)), []


def broadcast(r: Draw, x) -> Built:
    if x.ndim > 2:
        return None
    axis, n = r.int(0, x.ndim), r.pick([1, 2, 3, 4])
    shape = x.shape[:axis] + (n,) + x.shape[axis:]
    return (lambda v: jnp.broadcast_to(jnp.expand_dims(v, axis), shape)), []


def squeeze(r: Draw, x) -> Built:
    ones = [i for i, d in enumerate(x.shape) if d == 1]
    if not ones:
        return None
    axis = r.pick(ones)
    return (lambda v: jnp.squeeze(v, axis)), []


def tile(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis, n = r.axis(x.ndim), r.int(2, 3)
    if r.coin():
        return (lambda v: jnp.repeat(v, n, axis=axis)), []
    return (lambda v: jnp.tile(v, [n if d == axis else 1 for d in range(v.ndim)])), []


# -- pad / slice / concatenate -------------------------------------------------------------
def pad(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    config = []
    for d in x.shape:
        lo, hi, interior = r.int(-2, 3), r.int(-2, 3), r.pick([0, 0, 1, 2])
        while d + (d - 1) * interior + lo + hi < 1:
            lo, hi = lo + 1, hi + 1
        config.append((lo, hi, interior) if r.coin(0.6) else (0, 0, 0))
    c = float(r.rng.uniform(-1, 1))
    return (lambda v: lax.pad(v, jnp.asarray(c, v.dtype), config)), []


def slice_(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    starts, limits, strides = [], [], []
    for d in x.shape:
        s = r.int(0, d - 1)
        starts.append(s)
        limits.append(r.int(s + 1, d))
        strides.append(r.pick([1, 1, 2, 3]))
    return (lambda v: lax.slice(v, starts, limits, strides)), []


def concatenate(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    other = list(x.shape)
    other[axis] = r.int(1, 4)
    first = r.coin()
    return (lambda v, p: jnp.concatenate([p, v, 2 * v] if first else [v, p], axis=axis)), \
        [r.normal(other, _dtype(x))]


def reverse(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axes = tuple(sorted({r.axis(x.ndim) for _ in range(r.int(1, 2))}))
    return (lambda v: jnp.flip(v, axes)), []


def roll(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis, shift = r.axis(x.ndim), r.int(-4, 4)
    return (lambda v: jnp.roll(v, shift, axis=axis)), []


# -- dynamic slices, gathers and scatters --------------------------------------------------
def dynamic_slice(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    size = r.int(1, x.shape[axis])
    return (lambda v, k: lax.dynamic_slice_in_dim(v, k, size, axis)), [np.int32(r.int(-1, x.shape[axis] + 1))]


def dynamic_update_slice(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    shape = [r.int(1, d) for d in x.shape]
    starts = [np.int32(r.int(-1, d)) for d in x.shape]
    return (lambda v, u, *ks: lax.dynamic_update_slice(v, u, ks)), [r.normal(shape, _dtype(x))] + starts


def take(r: Draw, x) -> Built:
    """A gather of whole slices along one dim; the indices constants or an input."""
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    idx = r.ints((r.int(1, 5),), 0, x.shape[axis] - 1)
    if r.coin():
        return (lambda v: jnp.take(v, idx, axis=axis)), []
    return (lambda v, i: jnp.take(v, i, axis=axis, mode="clip")), [idx]


def take_along_axis(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    idx = r.ints(x.shape, 0, x.shape[axis] - 1)
    return (lambda v, i: jnp.take_along_axis(v, i, axis=axis, mode="clip")), [idx]


def point_gather(r: Draw, x) -> Built:
    """v[i, j]: indices into two dims at once."""
    if x.ndim < 2:
        return None
    n = r.int(1, 6)
    i, j = r.ints((n,), 0, x.shape[0] - 1), r.ints((n,), 0, x.shape[1] - 1)
    return (lambda v, i, j: v[i, j]), [i, j]


def scatter(r: Draw, x) -> Built:
    """x.at[idx].add/max/mul/set(u) along dim 0 (set: distinct indices, its order undefined)."""
    if x.ndim == 0:
        return None
    how = r.pick(["add", "max", "min", "mul", "set"])
    n = r.int(1, x.shape[0] if how == "set" else 5)
    idx = (r.rng.permutation(x.shape[0])[:n] if how == "set" else r.ints((n,), 0, x.shape[0] - 1)).astype(np.int32)
    u = r.normal((n,) + x.shape[1:], _dtype(x))
    return (lambda v, i, u: getattr(v.at[i], how)(u)), [idx, u]


def segment_sum(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    n = r.int(1, 5)
    ids = r.ints((x.shape[0],), 0, n - 1)
    return (lambda v, ids: jax.ops.segment_sum(v, ids, num_segments=n)), [ids]


# -- cumulative, sort ----------------------------------------------------------------------
def cumulative(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis, rev = r.axis(x.ndim), r.coin(0.3)
    f = r.pick([lax.cumsum, lax.cummax, lax.cummin, lax.cumlogsumexp, lambda v, **k: lax.cumprod(jnp.tanh(v), **k)])
    return (lambda v: f(v, axis=axis, reverse=rev)), []


def sort(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    return (lambda v: jnp.sort(v, axis=axis)), []


def sort_by_key(r: Draw, x) -> Built:
    """Sort x by another input's keys (two operands, one key)."""
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    return (lambda v, k: lax.sort((k, v), dimension=axis, num_keys=1)[1]), [r.normal(x.shape, np.float32)]


def argsort_gather(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    axis = r.axis(x.ndim)
    return (lambda v, p: jnp.take_along_axis(p, jnp.argsort(v, axis=axis), axis=axis) + v), \
        [r.normal(x.shape, _dtype(x))]


def top_k(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    k = r.int(1, x.shape[-1])
    return (lambda v: lax.top_k(v, k)[0]), []


# -- convolution and pooling ---------------------------------------------------------------
def conv(r: Draw, x) -> Built:
    """A 1-d (rank 3, NWC) or 2-d (rank 4, NHWC) convolution: strides, padding, dilations,
    feature groups at random."""
    if x.ndim not in (3, 4):
        return None
    spatial, c = x.ndim - 2, x.shape[-1]
    groups = c if c > 1 and r.coin(0.3) else 1
    out = groups * r.int(1, 2)
    k = [r.int(1, 3) for _ in range(spatial)]
    strides = [r.pick([1, 1, 2]) for _ in range(spatial)]
    rhs_dil = [r.pick([1, 1, 2]) for _ in range(spatial)]
    lhs_dil = [r.pick([1, 1, 1, 2]) for _ in range(spatial)]
    padding = [(r.int(0, 2), r.int(0, 2)) for _ in range(spatial)]
    for i, d in enumerate(x.shape[1:-1]):
        if (d - 1) * lhs_dil[i] + 1 + sum(padding[i]) < (k[i] - 1) * rhs_dil[i] + 1:
            return None
    layout = ("NWC", "WIO", "NWC") if spatial == 1 else ("NHWC", "HWIO", "NHWC")
    w = r.normal(tuple(k) + (c // groups, out), _dtype(x), 0.5)
    return (lambda v, w: lax.conv_general_dilated(v, w, strides, padding, lhs_dil, rhs_dil, layout,
                                                  feature_group_count=groups)), [w]


def pool(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    window = [r.pick([1, 1, 2, 3]) if d > 2 else 1 for d in x.shape]
    strides = [r.pick([1, 2]) for _ in x.shape]
    padding = [(r.int(0, 1), r.int(0, 1)) for _ in x.shape]
    if r.coin():
        return (lambda v: lax.reduce_window(v, -jnp.inf, lax.max, window, strides, padding)), []
    return (lambda v: lax.reduce_window(v, 0.0, lax.add, window, strides, padding) / np.prod(window)), []


# -- control flow --------------------------------------------------------------------------
def scan(r: Draw, x) -> Built:
    if x.ndim == 0:
        return None
    rev = r.coin(0.3)

    def body(c, row):
        return jnp.tanh(c * 0.5 + row), c * row

    return (lambda v: lax.scan(body, jnp.zeros_like(v[0]), v, reverse=rev)[1]), []


def scan_with_input(r: Draw, x) -> Built:
    """A scan over x and a second input, the final carry added back."""
    if x.ndim == 0:
        return None
    p = r.normal(x.shape, _dtype(x))

    def body(c, xs):
        row, q = xs
        c = jnp.sin(c) + row * q
        return c, c

    return (lambda v, p: (lambda c, ys: ys + c)(*lax.scan(body, jnp.zeros_like(v[0]), (v, p)))), [p]


def cond(r: Draw, x) -> Built:
    f, g = r.pick(UNARY), r.pick(UNARY)
    if r.coin():
        return (lambda v: lax.cond(jnp.sum(v) > 0, f, g, v)), []
    return (lambda v, k: lax.cond(k > 0, f, g, v)), [np.int32(r.int(-1, 1))]


def switch(r: Draw, x) -> Built:
    fs = [r.pick(UNARY) for _ in range(3)]
    return (lambda v, k: lax.switch(k, fs, v)), [np.int32(r.int(-1, 3))]


def fori_loop(r: Draw, x) -> Built:
    def body(i, c):
        return jnp.tanh(c) + i.astype(c.dtype) * 0.1

    if r.coin(0.7):
        n = r.int(0, 3)
        return (lambda v: lax.fori_loop(0, n, body, v)), []
    return (lambda v, k: lax.fori_loop(0, k, body, v)), [np.int32(r.int(0, 3))]


def while_loop(r: Draw, x) -> Built:
    """A data-dependent trip count (halve until small)."""
    limit = float(r.rng.uniform(0.1, 2))

    def body(s):
        i, v = s
        return i + 1, v * 0.5

    return (lambda v: lax.while_loop(lambda s: (jnp.max(jnp.abs(s[1])) > limit) & (s[0] < 8), body, (0, v))[1]), []


def remat(r: Draw, x) -> Built:
    f, g = r.pick(UNARY), r.pick(UNARY)
    return (lambda v: jax.checkpoint(lambda a: f(g(a)) * 2)(v)), []


# -- random numbers ------------------------------------------------------------------------
def random(r: Draw, x) -> Built:
    kind = r.pick(["normal", "uniform", "dropout", "split"])

    def noise(v, seed):
        key = jax.random.key(seed)
        if kind == "normal":
            return v + 0.1 * jax.random.normal(key, v.shape, v.dtype)
        if kind == "uniform":
            return v * jax.random.uniform(key, v.shape, v.dtype, 0.5, 1.5)
        if kind == "dropout":
            return jnp.where(jax.random.bernoulli(key, 0.7, v.shape), v / 0.7, 0)
        a, b = jax.random.split(jax.random.fold_in(key, 3))
        return v + jax.random.normal(a, v.shape, v.dtype) * jax.random.uniform(b, (), v.dtype)

    return noise, [np.int32(r.int(0, 1000))]


FAMILIES: dict[str, Callable[[Draw, object], Built]] = {
    "unary": unary, "binary": binary, "select": select, "clip": clip, "convert": convert, "iota_mask": iota_mask,
    "matmul": matmul, "tensordot": tensordot, "batched_einsum": batched_einsum, "outer": outer,
    "self_dot": self_dot, "reduce": reduce, "softmax": softmax, "logsumexp": logsumexp, "layer_norm": layer_norm,
    "argmax": argmax, "reshape": reshape, "merge_or_split": merge_or_split, "transpose": transpose,
    "broadcast": broadcast, "squeeze": squeeze, "tile": tile, "pad": pad, "slice": slice_,
    "concatenate": concatenate, "reverse": reverse, "roll": roll, "dynamic_slice": dynamic_slice,
    "dynamic_update_slice": dynamic_update_slice, "take": take, "take_along_axis": take_along_axis,
    "point_gather": point_gather, "scatter": scatter, "segment_sum": segment_sum, "cumulative": cumulative,
    "sort": sort, "sort_by_key": sort_by_key, "argsort_gather": argsort_gather, "top_k": top_k, "conv": conv,
    "pool": pool, "scan": scan, "scan_with_input": scan_with_input, "cond": cond, "switch": switch,
    "fori_loop": fori_loop, "while_loop": while_loop, "remat": remat, "random": random,
}
