"""Common jax.numpy, jax.nn, jax.lax, jax.random and jax.scipy calls on an operand split
over both axes of a 2x4 mesh (uneven: 12 columns over 4, rows of 8 over 2, and slices of
them), each partitioned and run as one device runs it: the breadth a user's train step
draws from. Out-of-scope ones (complex numbers, FFTs) raise a
ShardingError that says so."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
IDS = np.array([3, 1, 0, 2, 5, 7, 6, 4], np.int32)   # integer labels and indices

CALLS = {
    "tile": lambda a: jnp.tile(a, (2, 1)),
    "repeat": lambda a: jnp.repeat(a, 2, axis=0),
    "cumsum": lambda a: jnp.cumsum(a, 1),
    "cumprod": lambda a: jnp.cumprod(a, 0),
    "argmax": lambda a: jnp.argmax(a, 1),
    "sort": lambda a: jnp.sort(a, 1),
    "argsort": lambda a: jnp.argsort(a, 1),
    "norm": lambda a: jnp.linalg.norm(a, axis=1),
    "clip": lambda a: jnp.clip(a, -0.5, 0.5),
    "one_hot": lambda a: jax.nn.one_hot(jnp.argmax(a, 1), 12),
    "take_along": lambda a: jnp.take_along_axis(a, jnp.argsort(a, 1), 1),
    "pad": lambda a: jnp.pad(a, ((1, 2), (0, 3))),
    "roll": lambda a: jnp.roll(a, 3, 1),
    "flip": lambda a: jnp.flip(a, 1),
    "triu": lambda a: jnp.triu(a),
    "tril": lambda a: jnp.tril(a, -1),
    "outer": lambda a: jnp.outer(a[0], a[1]),
    "logsumexp": lambda a: jax.nn.logsumexp(a, 1),
    "var": lambda a: jnp.var(a, 0),
    "median": lambda a: jnp.median(a, 1),
    "percentile": lambda a: jnp.percentile(a, 30, axis=1),
    "searchsorted": lambda a: jnp.searchsorted(jnp.sort(a[0]), a[1]),
    "diff": lambda a: jnp.diff(a, axis=1),
    "kron": lambda a: jnp.kron(a[:2, :2], a[:3, :3]),
    "trace": lambda a: jnp.trace(a),
    "diag": lambda a: jnp.diag(a[:, :8]),
    "interp": lambda a: jnp.interp(a[0], jnp.sort(a[1]), a[2]),
    "meshgrid": lambda a: jnp.meshgrid(a[0], a[1])[0] * 1.0,
    "where": lambda a: jnp.where(a > 0, a, 0.0),
    "top_k": lambda a: jax.lax.top_k(a, 3)[0],
    "softmax": lambda a: jax.nn.softmax(a),
    "einsum": lambda a: jnp.einsum("ij,kj->ik", a, a),
    "max_pool": lambda a: jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (2, 2), (2, 2), "VALID"),
    "stack": lambda a: jnp.stack([a, a * 2], 1),
    "concat": lambda a: jnp.concatenate([a, a], 1),
    "split": lambda a: jnp.split(a, 3, 1)[1],
    "expand": lambda a: jnp.expand_dims(a, 1) * 1,
    "squeeze": lambda a: jnp.squeeze(a[:, :1], 1),
    "swap": lambda a: jnp.swapaxes(a, 0, 1),
    "moveaxis": lambda a: jnp.moveaxis(a[None], 0, 2),
    "round": lambda a: jnp.round(a, 2),
    "isnan": lambda a: jnp.isnan(a).astype(jnp.float32),
    "nan_to_num": lambda a: jnp.nan_to_num(a),
    "erf": lambda a: jax.scipy.special.erf(a),
    "gelu": lambda a: jax.nn.gelu(a, approximate=False),
    "silu": lambda a: jax.nn.silu(a),
    "softplus": jax.nn.softplus,
    "cosine": lambda a: jnp.dot(a, a.T) / jnp.linalg.norm(a),
    "argmin": lambda a: jnp.argmin(a, 0),
    "any": lambda a: jnp.any(a > 1, 1).astype(jnp.float32),
    "all": lambda a: jnp.all(a > -3).astype(jnp.float32),
    "prod": lambda a: jnp.prod(a, 1),
    "max": lambda a: jnp.max(a, 1),
    "mean_keep": lambda a: jnp.mean(a, 1, keepdims=True),
    "std": lambda a: jnp.std(a, 1),
    "linspace": lambda a: a + jnp.linspace(0, 1, 12),
    "arange": lambda a: a + jnp.arange(12.0),
    "eye": lambda a: a[:, :8] + jnp.eye(8),
    "full_like": lambda a: jnp.full_like(a, 2.0) + a,
    "sign": jnp.sign,
    "abs_grad": jax.grad(lambda a: jnp.sum(jnp.abs(a))),
    "sort_grad": jax.grad(lambda a: jnp.sum(jnp.sort(a, 1) * jnp.arange(12.0))),
    "cumsum_grad": jax.grad(lambda a: jnp.sum(jnp.cumsum(a, 1) ** 2)),
    "cummax": lambda a: jax.lax.cummax(a, 1),
    "logcumsumexp": lambda a: jax.lax.cumlogsumexp(a, 1),
    "stack_grad": jax.grad(lambda a: jnp.sum(jnp.stack([a, a ** 2]) ** 2)),
    "unique": lambda a: jnp.unique(jnp.round(a[0]), size=5, fill_value=0.0),
    "bincount": lambda a: jnp.bincount(jnp.argmax(a, 1), length=12),
    "histogram": lambda a: jnp.histogram(a, bins=4, range=(-2, 2))[0],
    "cross_entropy": lambda a: -jnp.sum(jax.nn.log_softmax(a) * jax.nn.one_hot(IDS, 12)),
    "int_label_loss": lambda a: -jnp.take_along_axis(jax.nn.log_softmax(a), IDS[:, None], 1).mean(),
    "matrix_power": lambda a: jnp.linalg.matrix_power(a[:, :8], 2),
    "polyval": lambda a: jnp.polyval(jnp.array([1.0, 2.0, 3.0]), a),
    "lerp": lambda a: a + 0.3 * (a[::-1] - a),
    "atleast": lambda a: jnp.atleast_3d(a) * 1,
    "block": lambda a: jnp.block([[a, a], [a, a]]),
    "hstack": lambda a: jnp.hstack([a, a]),
    "vstack": lambda a: jnp.vstack([a, a]),
    "dstack": lambda a: jnp.dstack([a, a]),
    "column_stack": lambda a: jnp.column_stack([a[0], a[1]]),
    "reciprocal": jnp.reciprocal,
    "power": lambda a: jnp.power(jnp.abs(a), 1.5),
    "hypot": lambda a: jnp.hypot(a, a),
    "logaddexp": lambda a: jnp.logaddexp(a, a * 2),
    "dropout": lambda a: a * jax.random.bernoulli(jax.random.key(0), 0.9, a.shape) / 0.9,
    "normal": lambda a: a + jax.random.normal(jax.random.PRNGKey(1), a.shape),
    "categorical": lambda a: jax.random.categorical(jax.random.key(2), a).astype(jnp.float32),
    "permutation": lambda a: jax.random.permutation(jax.random.key(3), a, axis=1),
    "lax.map": lambda a: jax.lax.map(lambda r: r * 2, a),
    "fori": lambda a: jax.lax.fori_loop(0, 3, lambda k, c: c * 1.1, a),
    "while": lambda a: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, a))[1],
    "cond": lambda a: jax.lax.cond(a.sum() > 0, lambda v: v * 2, lambda v: v - 1, a),
    "switch": lambda a: jax.lax.switch(1, [lambda v: v, lambda v: v * 3], a),
    "vmap_dot": lambda a: jax.vmap(jnp.dot)(a, a),
    "checkpoint": jax.grad(lambda a: jnp.sum(jax.checkpoint(jnp.sin)(a))),
    "remat_scan": jax.grad(lambda a: jnp.sum(jax.lax.scan(jax.checkpoint(lambda c, r: (c + jnp.sin(r), None)),
                                                         jnp.zeros(12), a)[0])),
    "associative_scan": lambda a: jax.lax.associative_scan(jnp.add, a, axis=1),
    "reduce_precision": lambda a: jax.lax.reduce_precision(a, 5, 10),
    "bitcast": lambda a: jax.lax.bitcast_convert_type(a, jnp.int32).astype(jnp.float32),
    "nextafter": lambda a: jnp.nextafter(a, a + 1),
    "rem": lambda a: jnp.remainder(a, 0.3),
    "floor_divide": lambda a: jnp.floor_divide(a, 0.3),
    "clz": lambda a: jax.lax.clz(jnp.abs(a * 10).astype(jnp.int32)).astype(jnp.float32),
    "approx_max_k": lambda a: jax.lax.approx_max_k(a, 2)[0],
    "conv1d": lambda a: jnp.convolve(a[0], a[1][:3]),
    "correlate": lambda a: jnp.correlate(a[0], a[1][:3]),
    "image_resize": lambda a: jax.image.resize(a, (16, 24), "linear"),
    "segment_sum": lambda a: jax.ops.segment_sum(a, IDS % 3, num_segments=3),
    "dynamic_slice": lambda a: jax.lax.dynamic_slice_in_dim(a, IDS[0], 4, 1),
    "gather_nd": lambda a: a[IDS % 8, IDS % 12],
    "at_set": lambda a: a.at[IDS % 8, 2].set(1.0),
    "at_add": lambda a: a.at[:, IDS % 12].add(1.0),
    "at_max": lambda a: a.at[IDS % 8].max(0.5),
    "at_min": lambda a: a.at[IDS % 8].min(0.5),
    "at_mul": lambda a: a.at[IDS % 8].multiply(2.0),
    "nonzero_size": lambda a: jnp.nonzero(a[0] > 0, size=4)[0].astype(jnp.float32),
    "argwhere": lambda a: jnp.argwhere(a[0] > 0, size=3).astype(jnp.float32),
    "select_n": lambda a: jax.lax.select_n(jnp.broadcast_to(jnp.argmax(a, 1)[:, None] % 3, a.shape), a, a * 2, a * 3),
    "sinc": jnp.sinc,
    "i0": lambda a: jnp.i0(a),
    "logit": lambda a: jax.scipy.special.logit(jax.nn.sigmoid(a)),
    "xlogy": lambda a: jax.scipy.special.xlogy(a, jnp.abs(a) + 1),
    "gammaln": lambda a: jax.scipy.special.gammaln(jnp.abs(a) + 1),
    "erfinv": lambda a: jax.scipy.special.erfinv(jnp.tanh(a) * 0.9),
    "ndtri": lambda a: jax.scipy.special.ndtri(jax.nn.sigmoid(a)),
    "tensordot": lambda a: jnp.tensordot(a, a, axes=([1], [1])),
    "matmul_batched": lambda a: jnp.matmul(a.reshape(2, 4, 12), a.reshape(2, 12, 4)),
    "vdot": lambda a: jnp.vdot(a, a),
    "inner": lambda a: jnp.inner(a, a),
    "cross": lambda a: jnp.cross(a[:, :3], a[:, 3:6]),
    "rot90": lambda a: jnp.rot90(a),
    "ravel": lambda a: a.ravel() * 1,
    "resize": lambda a: jnp.resize(a, (4, 24)),
    "select_dtype": lambda a: a.astype(jnp.bfloat16).astype(jnp.float32),
    "float16": lambda a: (a.astype(jnp.float16) * 2).astype(jnp.float32),
    "int8": lambda a: (a * 10).astype(jnp.int8).astype(jnp.float32),
    "uint": lambda a: (jnp.abs(a) * 10).astype(jnp.uint32).astype(jnp.float32),
    "shift": lambda a: jnp.right_shift((jnp.abs(a) * 100).astype(jnp.int32), 2).astype(jnp.float32),
    "lax.reduce": lambda a: jax.lax.reduce(a, 0.0, jax.lax.add, (1,)),
    "pmax_argmax": lambda a: jax.lax.argmax(a, 1, jnp.int32).astype(jnp.float32),
    "custom_jvp": jax.nn.relu6,
    "custom_vjp_grad": jax.grad(lambda a: jnp.sum(jax.nn.relu6(a))),
    "optax_like": lambda a: a - 0.1 * jnp.sign(a) * jnp.sqrt(jnp.abs(a)),
    "linalg_cholesky": lambda a: jnp.linalg.cholesky(a[:, :8] @ a[:, :8].T + 8 * jnp.eye(8)),
    "linalg_inv": lambda a: jnp.linalg.inv(a[:, :8] + 8 * jnp.eye(8)),
    "ragged_dot": lambda a: jax.lax.ragged_dot(a, a.reshape(8, 12, 1)[:3] * a[:3, :, None], jnp.array([3, 4, 0], jnp.int32)),
    "scan_unroll": lambda a: jax.lax.scan(lambda c, r: (c * 0.5 + r, c), jnp.zeros(12), a, unroll=2)[1],
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_call_equals_one_device(name):
    x = np.random.RandomState(0).standard_normal((8, 12)).astype(np.float32)
    check(lambda a: CALLS[name](gspmd.mesh_split(a, MESH, ["x", "y"])), x, mesh=MESH, backends=("sim",))


@pytest.mark.parametrize("call,what", [
    (lambda a: jnp.abs(jnp.fft.rfft(a, axis=1)), "complex"),
    (lambda a: jnp.abs(a + 1j * a), "complex")])
def test_out_of_scope_calls_say_why(call, what):
    x = np.ones((8, 12), np.float32)
    with pytest.raises(gspmd.ShardingError, match=what):
        gspmd.jit(lambda a: call(gspmd.mesh_split(a, MESH, ["x", "y"])), mesh=MESH)(x)


@pytest.mark.parametrize("call,what", [
    (lambda a: jax.jvp(lambda v: jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (2, 2), (2, 2), "VALID"),
                       (a,), (a,))[1], "reverse mode")])
def test_calls_gspmd_has_no_rule_for_say_what_to_do_instead(call, what):
    x = np.ones((8, 12), np.float32)
    with pytest.raises(gspmd.ShardingError, match=what):
        gspmd.jit(lambda a: call(gspmd.mesh_split(a, MESH, ["x", "y"])), mesh=MESH)(x)
