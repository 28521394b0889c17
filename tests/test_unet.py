"""A small 3D U-Net trains with its spatial dims split over 8 devices, equal to one device."""
import numpy as np
import pytest
from util import check

import gspmd
from gspmd.models import unet



@pytest.mark.parametrize("mesh_shape,axes", [((2, 2, 2), ("d", "h", "w")), ((8,), ("d", -1, -1))])
def test_unet_train_step_spatially_partitioned(mesh_shape, axes):
    names = tuple(a for a in axes if a != -1)
    mesh = gspmd.Mesh(np.arange(8).reshape(mesh_shape), names)
    rng = np.random.RandomState(0)
    params = unet.init_params(rng)
    x = rng.standard_normal((2, 2, 8, 8, 8)).astype(np.float32)
    y = rng.standard_normal((2, 1, 8, 8, 8)).astype(np.float32)
    low = check(unet.make_train_step(mesh, axes), params, x, y, mesh=mesh)
    report = low.report()
    kinds = report.counts()
    assert kinds["collective-permute"] > 0, str(report)
    # Activations never travel whole: no all-gather, data moves as halos (and gradients
    # of the replicated weights are all-reduced).
    assert set(kinds) <= {"collective-permute", "all-reduce"}, str(report)
