"""Complex numbers: rotary embeddings written with complex multiplication (as LLaMA's
reference code), FFTs (jnp.fft: spectral layers, FNO), complex matmuls and sums, forward
and backward, equal to one device on both backends on uneven splits. Element-wise and
contraction ops partition as for real numbers; an FFT partitions along its batch dims,
its transformed dims whole."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspmd
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
RNG = np.random.RandomState(0)
X = RNG.standard_normal((6, 10, 8)).astype(np.float32)   # [batch, sequence, features]: 6 and 10 uneven over 4


def split(x, *dims):
    return gspmd.mesh_split(x, MESH, list(dims))


def collectives(low) -> list[str]:
    return sorted(c.kind for c in low.report().collectives)


def rotary(x):
    """Rotate feature pairs by position-dependent angles: x as complex numbers times
    e^(i * position * frequency)."""
    half = x.shape[-1] // 2
    z = jax.lax.complex(x[..., :half], x[..., half:])
    angles = jnp.arange(x.shape[1])[:, None] * (1e-2 ** (jnp.arange(half) / half))
    z = z * jnp.exp(1j * angles)
    return jnp.concatenate([jnp.real(z), jnp.imag(z)], axis=-1)


def test_rotary_embedding_in_complex_form_needs_no_communication():
    low = check(lambda x: rotary(split(x, "x", "y", -1)), X, mesh=MESH)
    assert collectives(low) == []


def test_rotary_embedding_gradient():
    w = RNG.standard_normal((8, 8)).astype(np.float32)
    loss = lambda x, w: jnp.sum(jnp.tanh(rotary(split(x, "x", "y", -1)) @ split(w, -1, "y")) ** 2)
    check(jax.grad(loss, (0, 1)), X, w, mesh=MESH)


FFTS = {
    "fft": lambda x: jnp.fft.fft(x, axis=-1),
    "ifft": lambda x: jnp.fft.ifft(x + 1j * x[..., ::-1], axis=-1),
    "rfft": lambda x: jnp.fft.rfft(x, axis=-1),
    "irfft": lambda x: jnp.fft.irfft(jnp.fft.rfft(x, axis=-1), 8, axis=-1),
    "rfft2": lambda x: jnp.abs(jnp.fft.rfft2(x)),
    "fftn_padded": lambda x: jnp.fft.fftn(x, s=(12, 16), axes=(1, 2)),
}


@pytest.mark.parametrize("name", sorted(FFTS))
def test_fft_along_whole_dims_runs_where_the_data_lies(name):
    low = check(lambda x: FFTS[name](split(x, "y", -1, -1)), X, mesh=MESH, rtol=1e-3, atol=1e-3)
    assert "all-gather" not in collectives(low)


def test_fft_along_a_split_dim_moves_it_first():
    low = check(lambda x: jnp.fft.fft(split(x, -1, -1, "y"), axis=-1), X, mesh=MESH, rtol=1e-3, atol=1e-3)
    assert collectives(low)


def test_spectral_convolution_trains():
    """A Fourier neural operator's layer: FFT along the sequence, a complex channel mix of
    the lowest modes, inverse FFT; its gradient with respect to real and imaginary
    weights, the batch split."""
    modes = 4
    w_re, w_im = (RNG.standard_normal((modes, 8, 8)).astype(np.float32) / 8 for _ in range(2))

    def layer(x, w_re, w_im):
        spectrum = jnp.fft.rfft(split(x, "y", -1, -1), axis=1)[:, :modes]
        mixed = jnp.einsum("bmi,mio->bmo", spectrum, jax.lax.complex(w_re, w_im))
        return jnp.fft.irfft(mixed, x.shape[1], axis=1)

    loss = lambda *a: jnp.sum(jnp.tanh(layer(*a)) ** 2)
    low = check(jax.value_and_grad(loss, (1, 2)), X, w_re, w_im, mesh=MESH, rtol=1e-3, atol=1e-3)
    assert "all-gather" not in collectives(low)


def test_complex_matmul_and_sums():
    def f(x):
        z = split(x, "x", "y", -1) * (1 + 2j)
        return z @ jnp.conj(jnp.swapaxes(z, 1, 2)), jnp.sum(z, axis=1), jnp.abs(z).max(), jnp.angle(z)
    low = check(f, X, mesh=MESH)
    assert "all-reduce" in collectives(low)   # the sum over the split sequence, in complex numbers
