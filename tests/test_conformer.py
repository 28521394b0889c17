"""The Conformer block (convolution module, attention, feed-forwards) partitioned: batch
over one mesh axis and time over the other, so the depthwise convolution exchanges halos."""
import jax
import jax.numpy as jnp
import numpy as np

import gspmd
from gspmd.models import conformer, transformer
from util import check

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def test_conformer_train_step_with_time_split():
    cfg = conformer.Config(batch=4, seq=12, model=8, heads=2, head_dim=4, hidden=16, layers=2, kernel=3)
    params, x, target = conformer.example_inputs(cfg)
    annotate = transformer.gspmd_annotate(MESH)

    def step(params, x, target):
        def loss(params):
            h = x
            for p in params:
                h = conformer.layer(p, h, annotate, {"x": ["x", "y", -1]}, cfg)
            return jnp.mean((h - target) ** 2)
        return jax.value_and_grad(loss)(params)

    counts = check(step, params, x, target, mesh=MESH).report().counts()
    assert counts["collective-permute"] >= 2      # the depthwise convolution's halos, forward and backward
    assert "all-to-all" not in counts
