"""Randomness: JAX's threefry2x32 PRNG, generated where the values live; and JAX's rbg
PRNGs (jax.random.key(seed, impl="rbg" / "unsafe_rbg")), as JAX computes them: threefry
hashes of the key data and XLA's RngBitGenerator (rng-bit-generator, below).

The IR has no key dtype: a key array of shape K is its uint32 key data, shape K + (2,)
(rbg: K + (4,)), everywhere in a Program (frontend/keys.py converts at gspmd.jit's
boundary and for the ops that merely move keys around). The `random_*` primitives of
threefry keys become one element-wise op,
`threefry2x32` (two key words and two counter words in, two hashed words out), fed with
iota-based counters. With JAX's partitionable threefry (jax_threefry_partitionable, the
default) each random element's counter is its row-major index in the generated array, so
every device hashes only the counters of its own shard: iota partitions with each
shard's offset, and nothing is communicated.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.extend.random import threefry2x32_p, threefry_prng_impl

from gspmd.errors import ShardingError
from gspmd.ir import Value
from gspmd.ops.convert import Conversion
from gspmd.ops.registry import (ELEMENTWISE, Frontend, Memory, Rule, Semantics, Storage, Timing,
                                elementwise_factors, register, replicate_fallback)

UINT32 = np.dtype(np.uint32)
# Vector instructions per hash: threefry2x32's 20 rounds of an add, a rotation (one funnel
# shift on a GPU) and a xor, its 5 key injections of 3 adds and its key schedule, for a
# pair of words; Philox4x32-10 (RngBitGenerator on GPUs) 10 rounds of two 32x32 -> 64-bit
# multiplies (2 instructions each), 4 xors and 2 key adds, for 4 words: per word.
THREEFRY_OPS, PHILOX_OPS = 80, 25


# -- the hash: threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers:
# as easy as 1, 2, 3"), exactly as jax.random computes it ---------------------------------
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k1: np.ndarray, k2: np.ndarray, x1: np.ndarray, x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy reference: uint32 arrays of one shape in, the two hashed words out."""
    keys = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x = [x1 + keys[0], x2 + keys[1]]
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x[0] = x[0] + x[1]
            x[1] = (x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r))
            x[1] = x[0] ^ x[1]
        x[0] = x[0] + keys[(block + 1) % 3]
        x[1] = x[1] + keys[(block + 2) % 3] + np.uint32(block + 1)
    return x[0], x[1]


def _evaluate_threefry(instr, args, device):
    with np.errstate(over="ignore"):   # uint32 arithmetic wraps, as intended
        return [np.asarray(x, UINT32) for x in threefry2x32(*(np.asarray(a, UINT32) for a in args))]


def _lower_threefry(instr, args, lc):
    return list(threefry2x32_p.bind(*args))


# -- key data -----------------------------------------------------------------------------
def key_words(b: Conversion, data: Value) -> list[Value]:
    """The key data K + (n,) as its n words, each of shape K."""
    *shape, n = data.shape
    words = []
    for w in range(n):
        one = b.add1("slice", [data], (*shape, 1), data.dtype, start=(0,) * len(shape) + (w,),
                     limit=(*shape, w + 1), strides=(1,) * data.rank)
        words.append(b.add1("reshape", [one], tuple(shape), data.dtype))
    return words


def stack_words(b: Conversion, words: Sequence[Value]) -> Value:
    """n words of shape K as key data K + (n,)."""
    shape = words[0].shape
    column = [b.add1("reshape", [w], (*shape, 1), w.dtype) for w in words]
    return b.add1("concatenate", column, (*shape, len(words)), words[0].dtype, dimension=len(shape))


def _expand(b: Conversion, x: Value, shape: Sequence[int], offset: Optional[int] = None) -> Value:
    """x broadcast to `shape`, its dims at offset.. (default: aligned on the right, as
    NumPy does); its size-1 dims stretch."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    offset = len(shape) - x.rank if offset is None else offset
    kept = [d for d in range(x.rank) if x.shape[d] == shape[offset + d]]
    if len(kept) < x.rank:
        x = b.add1("reshape", [x], tuple(x.shape[d] for d in kept), x.dtype)
    return b.add1("broadcast", [x], shape, x.dtype, dims=tuple(offset + d for d in kept))


def _zeros(b: Conversion, shape: Sequence[int]) -> Value:
    return _uint(b, 0, shape)


def _counters(b: Conversion, shape: tuple[int, ...], first: int) -> tuple[Value, Value]:
    """The 64-bit row-major index of each element within dims first.. of `shape` (the
    same for every index of the dims before), as (high word, low word). Built from iotas,
    which partition with each shard's offset. Past 2**32 elements the index is q * P + r,
    r the index within the trailing dims (P of them, under 2**32) and q within the rest,
    in 32-bit words: the IR, like JAX without x64, has no 64-bit integers."""
    split = len(shape)
    while split > first and math.prod(shape[split - 1:]) < 2 ** 32:
        split -= 1
    low = _row_major(b, shape, split)
    if split == first:   # under 2**32 elements: the high word is 0
        return _zeros(b, shape), low
    if math.prod(shape[first:split]) >= 2 ** 32:
        raise ShardingError(f"gspmd generates at most 2**64 random values per key in one call; {shape[first:]} "
                            "asks for more. Split the key and generate in pieces.")
    high, product_low = _times(b, _row_major(b, shape, first, split), math.prod(shape[split:]))
    return _plus(b, high, product_low, low)


def _uint(b: Conversion, value: int, shape: Sequence[int]) -> Value:
    return b.broadcast_to(b.constant(value, UINT32), shape)


def _row_major(b: Conversion, shape: tuple[int, ...], first: int, end: Optional[int] = None) -> Value:
    """Each element's row-major index within dims first..end of `shape` (under 2**32)."""
    index, stride = None, 1
    for d in reversed(range(first, len(shape) if end is None else end)):
        if shape[d] > 1:
            term = b.add1("iota", [], shape, UINT32, dimension=d)
            if stride > 1:
                term = b.add1("multiply", [term, _uint(b, stride, shape)], shape, UINT32)
            index = term if index is None else b.add1("add", [index, term], shape, UINT32)
        stride *= shape[d]
    return _zeros(b, shape) if index is None else index


def _times(b: Conversion, x: Value, factor: int) -> tuple[Value, Value]:
    """x * factor (both under 2**32) as 64 bits (high word, low word), from 16-bit halves
    whose products fit in 32."""
    shape = x.shape
    by = lambda opcode, v, k: b.add1(opcode, [v, _uint(b, k, shape)], shape, UINT32)   # noqa: E731
    x_low, x_high = by("and", x, 0xFFFF), by("shift-right-logical", x, 16)
    f_low, f_high = factor & 0xFFFF, factor >> 16
    cross = [by("multiply", x_low, f_high), by("multiply", x_high, f_low)]   # each * 2**16
    high = by("multiply", x_high, f_high)
    for c in cross:
        high = b.add1("add", [high, by("shift-right-logical", c, 16)], shape, UINT32)
    high, low = _plus(b, high, by("multiply", x_low, f_low), by("shift-left", cross[0], 16))
    return _plus(b, high, low, by("shift-left", cross[1], 16))


def _plus(b: Conversion, high: Value, low: Value, addend: Value) -> tuple[Value, Value]:
    """(high, low) + addend in 64 bits: the low word wraps, its carry goes to the high."""
    shape = low.shape
    total = b.add1("add", [low, addend], shape, UINT32)
    carried = b.add1("compare", [total, low], shape, np.bool_, direction="LT")
    return b.add1("add", [high, b.add1("convert", [carried], shape, UINT32)], shape, UINT32), total


def _hash(b: Conversion, k1: Value, k2: Value, x1: Value, x2: Value) -> list[Value]:
    shape = x1.shape
    return b.add("threefry2x32", [k1, k2, x1, x2], [(shape, UINT32)] * 2)


def _hash_counters(b: Conversion, keys: Value, shape: tuple[int, ...]) -> list[Value]:
    """Each key (keys: key data K + (2,)) hashes the counters of its own block of
    `shape` = K + S: threefry(key, row-major index within S)."""
    first = keys.rank - 1
    k1, k2 = (_expand(b, w, shape, 0) for w in key_words(b, keys))
    return _hash(b, k1, k2, *_counters(b, shape, first))


# -- conversion of the random primitives --------------------------------------------------
def key_impl(dtype):
    """The PRNG implementation of a key dtype (jax.random.key(..., impl=...))."""
    return dtype._impl


def _is_threefry(impl) -> bool:
    return impl is threefry_prng_impl


def _inline_impl(b: Conversion, eqn, args: list[Value], fn, batch: int) -> list[Value]:
    """Another PRNG (rbg, unsafe_rbg): its implementation's function `fn` of one key's
    data (vmapped over the `batch` leading dims of every operand), as JAX computes it,
    inlined: threefry hashes and XLA's RngBitGenerator."""
    for _ in range(batch):
        fn = jax.vmap(fn)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return b.inline(jax.make_jaxpr(fn)(*avals), args)


def _check_partitionable(eqn) -> None:
    if not jax.config.jax_threefry_partitionable:
        raise ShardingError(
            f"`{eqn}` runs with jax_threefry_partitionable=False; gspmd reproduces JAX's partitionable threefry "
            "only, in which each random value's counter is its own index (so every device generates just its "
            "shard). Set jax.config.update('jax_threefry_partitionable', True), JAX's default.")


def _random_bits(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    impl, p = key_impl(eqn.invars[0].aval.dtype), eqn.params
    if not _is_threefry(impl):
        return _inline_impl(b, eqn, args, lambda k: impl.random_bits(k, p["bit_width"], p["shape"]), args[0].rank - 1)
    _check_partitionable(eqn)
    shape, dtype = b.out_aval(eqn)
    if eqn.params["bit_width"] == 64:
        raise ShardingError(f"`{eqn}` asks for 64-bit random values (jax_enable_x64); gspmd's random numbers "
                            "support 8-, 16- and 32-bit values. Generate 32-bit values, or run without x64.")
    b1, b2 = _hash_counters(b, args[0], shape)
    bits = b.add1("xor", [b1, b2], shape, UINT32)
    return [bits if dtype == UINT32 else b.add1("convert", [bits], shape, dtype)]


def _random_split(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    impl = key_impl(eqn.invars[0].aval.dtype)
    if not _is_threefry(impl):
        return _inline_impl(b, eqn, args, lambda k: impl.split(k, eqn.params["shape"]), args[0].rank - 1)
    _check_partitionable(eqn)
    shape, _ = b.out_aval(eqn)
    return [stack_words(b, _hash_counters(b, args[0], shape[:-1]))]


def _random_fold_in(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    """fold_in(key, m) = threefry(key, counter (0, m)); keys and messages broadcast."""
    (keys, msgs), (shape, _) = args, b.out_aval(eqn)
    shape = shape[:-1]
    impl = key_impl(eqn.invars[0].aval.dtype)
    if not _is_threefry(impl):
        keys = _expand(b, keys, (*shape, keys.shape[-1]), len(shape) - (keys.rank - 1))
        return _inline_impl(b, eqn, [keys, _expand(b, msgs, shape)], impl.fold_in, len(shape))
    k1, k2 = (_expand(b, w, shape) for w in key_words(b, keys))
    return [stack_words(b, _hash(b, k1, k2, _zeros(b, shape), _expand(b, msgs, shape)))]


def _random_seed(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    """A seed's key data is (high 32 bits, low 32 bits) of the seed."""
    impl, (seeds,) = eqn.params["impl"], args
    if not _is_threefry(impl):
        return _inline_impl(b, eqn, args, impl.seed, seeds.rank)
    if seeds.dtype.itemsize > 4:
        raise ShardingError(f"`{eqn}` seeds from 64-bit integers (jax_enable_x64); gspmd's random numbers "
                            "support 32-bit seeds. Run without x64.")
    low = seeds if seeds.dtype == UINT32 else b.add1("convert", [seeds], seeds.shape, UINT32)
    return [stack_words(b, [_zeros(b, seeds.shape), low])]


def _iota_2x32(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    """Each element's row-major index as (high word, low word): threefry's counters."""
    return list(_counters(b, tuple(eqn.params["shape"]), 0))


def _same_key_data(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    return [args[0]]


def _random_gamma(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    """jax.random.gamma (beta, dirichlet): the computation JAX lowers the primitive to on
    every platform (a key per element, rejection sampling vectorized over them), inlined."""
    from jax._src.random import core   # how JAX lowers random_gamma (renamed in jax 0.12.1)
    impl = getattr(core, "_gamma_impl", None) or core._gamma_impl_local
    sample = functools.partial(impl, log_space=eqn.params["log_space"], use_vmap=True)
    closed = jax.make_jaxpr(sample)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars))
    return b.inline(closed, args)


def _threefry(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    shape, _ = b.out_aval(eqn)
    return _hash(b, *(_expand(b, a, shape) for a in args))


register("threefry2x32",
         frontend=Frontend(converts={"threefry2x32": _threefry, "iota_2x32_shape": _iota_2x32},
                           converts_keys={"random_bits": _random_bits, "random_split": _random_split,
                                          "random_fold_in": _random_fold_in, "random_seed": _random_seed,
                                          "random_wrap": _same_key_data, "random_unwrap": _same_key_data,
                                          "random_clone": _same_key_data, "random_gamma": _random_gamma}),
         semantics=Semantics(evaluate=_evaluate_threefry, lower=_lower_threefry),
         rule=Rule(factors=elementwise_factors, priority=ELEMENTWISE),
         # XLA computes the hash's rounds (integer adds, rotations, xors) inside whatever
         # fusion reads the bits: a dropout mask is never a buffer of random words
         memory=Memory(storage=Storage.ELEMENTWISE),
         timing=Timing(vector_ops=lambda instr: THREEFRY_OPS * instr.outputs[0].nbytes // 4))


# -- rng-bit-generator: XLA's RngBitGenerator (the rbg PRNGs' random bits) -----------------
# Operand: the generator's state (uint32 key data); results: its next state and random
# bits of attrs shape and dtype, by attrs algorithm. The bits depend on the whole shape
# generated, so each device generates all of them and keeps its part, as XLA's
# partitioner does by default (a flag of XLA lets each device make numbers of its own).
def _convert_rng_bit_generator(b: Conversion, eqn, args: list[Value]) -> list[Value]:
    p = eqn.params
    return b.add("rng-bit-generator", args, [b.out_aval(eqn, i) for i in range(2)], shape=tuple(p["shape"]),
                 dtype=np.dtype(p["dtype"]), algorithm=p["algorithm"])


def _generate(instr, key):
    a = instr.attrs
    return list(jax.lax.rng_bit_generator(key, a["shape"], a["dtype"], a["algorithm"]))


def _evaluate_rng_bit_generator(instr, args, device):
    return [np.asarray(r) for r in _generate(instr, args[0])]


register("rng-bit-generator",
         timing=Timing(vector_ops=lambda instr: PHILOX_OPS * instr.outputs[1].nbytes // 4),
         frontend=Frontend(converts={"rng_bit_generator": _convert_rng_bit_generator}),
         semantics=Semantics(evaluate=_evaluate_rng_bit_generator, lower=lambda instr, args,
                             lc: _generate(instr, args[0])),
         rule=Rule(partition=replicate_fallback))
