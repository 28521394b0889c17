"""Matrix decompositions and solves (jnp.linalg, jax.scipy.linalg, the orthogonal
initializer) partitioned as XLA partitions them: a batch of matrices split on its batch
dim is decomposed where it lies, with no communication, forward and backward; a split
matrix dim is gathered first. Results equal one device's (LAPACK's, signs included)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest

import gspmd
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
RNG = np.random.RandomState(0)
A = RNG.standard_normal((6, 5, 5)).astype(np.float32)               # 6 matrices: uneven over 4
SPD = A @ A.transpose(0, 2, 1) + 5 * np.eye(5, dtype=np.float32)     # symmetric positive definite
B = RNG.standard_normal((6, 5, 3)).astype(np.float32)


def split(x, *dims):
    return gspmd.mesh_split(x, MESH, list(dims))


def collectives(low) -> list[str]:
    return sorted(c.kind for c in low.report().collectives)


DECOMPOSITIONS = {
    "cholesky": lambda a, s, b: jnp.linalg.cholesky(s),
    "qr": lambda a, s, b: jnp.linalg.qr(a),
    "qr_complete": lambda a, s, b: jnp.linalg.qr(a[:, :, :3], mode="complete"),
    "eigh": lambda a, s, b: jnp.linalg.eigh(s),
    "eigvalsh": lambda a, s, b: jnp.linalg.eigvalsh(s),
    "svd": lambda a, s, b: jnp.linalg.svd(a),
    "singular_values": lambda a, s, b: jnp.linalg.svd(a, compute_uv=False),
    "solve": lambda a, s, b: jnp.linalg.solve(s, b),
    "inv": lambda a, s, b: jnp.linalg.inv(a),
    "det_slogdet": lambda a, s, b: (jnp.linalg.det(a), jnp.linalg.slogdet(s)),
    "pinv": lambda a, s, b: jnp.linalg.pinv(a),
    "lstsq": lambda a, s, b: jnp.linalg.lstsq(a[0], b[0])[0],
    "lu": lambda a, s, b: jax.vmap(jsl.lu)(a),
    "lu_solve": lambda a, s, b: jsl.lu_solve(jsl.lu_factor(s), b),
    "cho_solve": lambda a, s, b: jsl.cho_solve(jsl.cho_factor(s), b),
    "solve_triangular": lambda a, s, b: jsl.solve_triangular(jnp.linalg.cholesky(s), b, lower=True),
    "expm": lambda a, s, b: jsl.expm(a / 4),
    "householder_product": lambda a, s, b: jax.lax.linalg.householder_product(a, jnp.full((6, 5), 0.5, np.float32)),
    "ormqr": lambda a, s, b: jax.lax.linalg.ormqr(a, jnp.full((6, 5), 0.5, np.float32), b),
    "symmetric_product": lambda a, s, b: jax.lax.linalg.symmetric_product(a, s, alpha=0.5, beta=2.0),
    "cholesky_update": lambda a, s, b: jax.lax.linalg.cholesky_update(jnp.linalg.cholesky(s[0]).T, b[0, :, 0]),
}


@pytest.mark.parametrize("name", sorted(DECOMPOSITIONS))
def test_batch_split_decomposes_where_it_lies(name):
    def f(a, s, b):
        return DECOMPOSITIONS[name](split(a, "y", -1, -1), split(s, "y", -1, -1), split(b, "y", -1, -1))
    low = check(f, A, SPD, B, mesh=MESH, rtol=1e-3, atol=1e-3)
    if name not in ("lstsq", "cholesky_update"):   # one matrix of the batch: no batch dim to split
        assert "all-gather" not in collectives(low)


def test_split_matrix_dim_is_gathered_first():
    def f(s):
        return jnp.linalg.cholesky(split(s, "y", -1, "x"))
    assert "all-gather" in collectives(check(f, SPD, mesh=MESH))


def test_gradients_need_no_communication_with_the_batch_split():
    def loss(a, s, b):
        a, s = split(a, "y", -1, -1), split(s, "y", -1, -1)
        q, r = jnp.linalg.qr(a)
        w, v = jnp.linalg.eigh(s)
        return (jnp.sum(jnp.linalg.cholesky(s) ** 2) + jnp.sum(q * r) + jnp.sum(w) + jnp.sum(v ** 4)
                + jnp.sum(jnp.linalg.solve(s, b) ** 2) + jnp.sum(jnp.linalg.slogdet(s)[1]))
    low = check(jax.grad(loss, (0, 1, 2)), A, SPD, B, mesh=MESH, rtol=1e-3, atol=1e-3)
    assert collectives(low) == []


def test_orthogonal_initializer_in_a_sharded_init():
    """Flax's LSTM cells initialize their recurrent kernels orthogonally (a QR): a
    sharded init runs it as jax.jit does."""
    def init(key, x):
        params = nn.OptimizedLSTMCell(16).init(key, nn.OptimizedLSTMCell(16).initialize_carry(key, x.shape), x)
        return jax.tree_util.tree_map(lambda p: split(p, -1, "y") if p.ndim == 2 else p, params)
    check(init, jax.random.key_data(jax.random.key(0)), np.ones((4, 8), np.float32), mesh=MESH, rtol=1e-3,
          atol=1e-3)


def test_eigenvalues_of_general_matrices_are_complex():
    low = check(lambda a: jnp.linalg.eig(split(a, "y", -1, -1)), A, mesh=MESH, rtol=1e-3, atol=1e-3)
    assert collectives(low) == []


def test_reports_count_the_decompositions_work():
    """Per device, its 2 of the 6 matrices: Cholesky n^3/3 each (besides the element-wise
    work around it); of 8 x 3 signals of 16, 2 x 3 FFTs of 5 N log2 N each."""
    chol = gspmd.jit(lambda s: jnp.linalg.cholesky(split(s, "y", -1, -1)), mesh=MESH).lower(SPD).report()
    assert chol.flops - chol.memory_bound_flops == 2 * 5 ** 3 // 3
    fft = gspmd.jit(lambda x: jnp.fft.fft(split(x, "y", -1, -1), axis=-1), mesh=MESH).lower(
        np.ones((8, 3, 16), np.complex64)).report()
    assert fft.flops - fft.memory_bound_flops == 2 * 3 * 5 * 16 * 4
