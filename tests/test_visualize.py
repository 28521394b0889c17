"""gspmd.visualize: which device holds which tile, as text (rich) and PNG (matplotlib),
for 1-D to 3-D values, from jax.Arrays (jax backend) and Lowered values (both backends)."""
import sys

import numpy as np
import pytest

import gspmd

MESH = gspmd.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))


def _split(dims_mapping):
    return gspmd.jit(lambda a: gspmd.mesh_split(a, MESH, dims_mapping) * 2, backend="jax")


def test_jax_array_2d_names_each_tile_and_its_devices():
    out = _split([None, "y"])(np.ones((4, 8), np.float32))
    text = gspmd.visualize(out, show=False)
    assert "P(None, 'y') over Mesh(x=2, y=4)" in text
    for lo, devices in zip((0, 2, 4, 6), ("0,4", "1,5", "2,6", "3,7")):
        assert f"[{lo}:{lo + 2}]" in text and f"devices {devices}" in text


@pytest.mark.parametrize("shape,dims_mapping,expect", [
    ((10,), ["y"], ["[0:3]", "[9:10]", "devices 3,7"]),                 # 1-D, uneven: last tile 1 wide
    ((4, 6), [("x", "y"), None], ["[0:1]", "[3:4]", "devices 3", "devices 4,5,6,7 hold only padding"]),
    ((4, 3, 10), ["x", None, "y"], ["dim 0 [0:2]", "dim 0 [2:4]", "devices 6"]),   # 3-D: a grid per dim-0 tile
])
def test_lowered_values_on_the_sim_backend(shape, dims_mapping, expect):
    low = gspmd.jit(lambda a: gspmd.mesh_split(a, MESH, dims_mapping) + 1).lower(np.ones(shape, np.float32))
    text = gspmd.visualize(low, "result", show=False)
    assert all(e in text for e in expect), text
    assert "result float32" in text


def test_png_is_written(tmp_path):
    low = gspmd.jit(lambda a: gspmd.mesh_split(a, MESH, ["x", None, "y"]) + 1).lower(np.ones((4, 3, 8), np.float32))
    path = tmp_path / "layout.png"
    gspmd.visualize(low, 0, png=str(path), show=False)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    arr = _split(["x", "y"])(np.ones((4, 8), np.float32))
    gspmd.visualize(arr, png=str(tmp_path / "array.png"), show=False)
    assert (tmp_path / "array.png").stat().st_size > 1000


def test_prints_when_shown(capsys):
    gspmd.visualize(_split(["x", None])(np.ones((4, 8), np.float32)))
    assert "devices 0,1,2,3" in capsys.readouterr().out


def test_clear_errors_for_bad_targets_and_missing_extras(monkeypatch):
    with pytest.raises(gspmd.ShardingError, match="rank 1 to 3"):
        gspmd.visualize(_split([None] * 4)(np.ones((2, 2, 2, 2), np.float32)), show=False)
    with pytest.raises(gspmd.ShardingError, match="jax.Array or a value of a Lowered"):
        gspmd.visualize(np.ones(3), show=False)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    with pytest.raises(ImportError, match=r"gspmd\[viz\]"):
        gspmd.visualize(_split(["x"])(np.ones(4, np.float32)), show=False)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"matplotlib: pip install 'gspmd\[viz\]'"):
        gspmd.visualize(_split(["x"])(np.ones(4, np.float32)), png="x.png", show=False)
