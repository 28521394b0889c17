"""gspmd.visualize: which device holds which tile of a value, in the terminal (rich) or
as a PNG (matplotlib). Both packages are optional: `pip install 'gspmd[viz]'`."""
from __future__ import annotations

import io
import os
from typing import Optional, Union

import jax

from gspmd.checks import describe, flag
from gspmd.errors import ShardingError
from gspmd.mesh import Mesh
from gspmd.runtime import sim
from gspmd.sharding import format_spec

Blocks = dict[tuple[tuple[int, int], ...], list[int]]   # per-dim [start, stop) of a tile -> its devices
_COLORS = ["red", "green", "blue", "magenta", "cyan", "yellow", "bright_red", "bright_green", "bright_blue",
           "bright_magenta", "bright_cyan", "bright_yellow"]


def visualize(target, which: Union[None, int, str] = None, *, png: Optional[str] = None, show: bool = True) -> str:
    """Draw which device holds which tile of a 1-D to 3-D value.

    `target` is a jax.Array (its sharding, as jax.debug.visualize_array_sharding), or a
    Lowered with `which` naming one of its values (pytree path like "params['w1']",
    output index, or %name; default: output 0), which covers the sim backend too.
    Prints a table (rich) when `show`, writes a PNG (matplotlib) to `png` if given,
    and returns the table as text. A 3-D value is drawn as one grid per tile of dim 0."""
    show = flag(show, "gspmd.visualize(show=...)")
    if png is not None and not isinstance(png, (str, os.PathLike)):
        raise ShardingError(f"gspmd.visualize(png=...) needs a file path (a str or pathlib.Path), got "
                            f"{describe(png)}; e.g. png='layout.png'.")
    title, shape, blocks = _layout(target, which)
    if not 1 <= len(shape) <= 3:
        raise ShardingError(f"gspmd.visualize draws values of rank 1 to 3; {title} has rank {len(shape)}. "
                            "Visualize a reshaped or sliced value instead, or read its layout with explain().")
    text = _text(title, shape, blocks, show)
    if png is not None:
        _png(png, title, shape, blocks)
    return text


def _layout(target, which) -> tuple[str, tuple[int, ...], Blocks]:
    if isinstance(target, jax.Array):
        if which is not None:
            raise ShardingError("gspmd.visualize(array, which): `which` names a value of a Lowered; for a "
                                "jax.Array leave it out.")
        shape = tuple(target.shape)
        blocks: Blocks = {}
        for device, index in sorted(target.sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id):
            key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
            blocks.setdefault(key, []).append(device.id)
        return f"{target.dtype}{list(shape)}: {_describe(target.sharding)}", shape, blocks
    if hasattr(target, "value") and hasattr(target, "describe"):        # a Lowered
        v = target.value(0 if which is None else which)
        blocks, padding = {}, []
        for d in range(v.sharding.num_devices):
            key = tuple((s.start, s.stop) for s in sim.tile_slices(v.sharding, v.shape, d))
            if all(stop > start for start, stop in key):
                blocks.setdefault(key, []).append(d)
            else:
                padding.append(d)
        note = f" (devices {','.join(map(str, padding))} hold only padding)" if padding else ""
        return f"{target.label(v)} {v.type_str()}: {target.describe(v.sharding)}{note}", v.shape, blocks
    raise ShardingError(f"gspmd.visualize draws a jax.Array or a value of a Lowered (step.lower(...)), got "
                        f"{type(target).__name__}; for a sim-backend result, visualize(step.lower(*args), 'result[0]').")


def _describe(sharding) -> str:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"{format_spec(sharding.spec)} over {Mesh.from_jax(sharding.mesh)}"
    return str(sharding)


def _ranges(blocks: Blocks, dim: int) -> list[tuple[int, int]]:
    return sorted({key[dim] for key in blocks})


def _grids(shape, blocks: Blocks) -> list[tuple[str, Blocks]]:
    """2-D pictures: one for 1-D/2-D values, one per tile of dim 0 for 3-D ones."""
    if len(shape) == 1:
        return [("", {((0, 1),) + key: devices for key, devices in blocks.items()})]
    if len(shape) == 2:
        return [("", blocks)]
    return [(f"dim 0 [{lo}:{hi}]", {key[1:]: devices for key, devices in blocks.items() if key[0] == (lo, hi)})
            for lo, hi in _ranges(blocks, 0)]


def _text(title: str, shape, blocks: Blocks, show: bool) -> str:
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        raise ImportError("gspmd.visualize needs the optional package rich: pip install 'gspmd[viz]'") from None
    console = Console(file=io.StringIO(), record=True, width=160)
    console.print(Text(title, style="bold"))
    colors: dict[tuple, str] = {}
    for caption, grid in _grids(shape, blocks):
        rows, cols = _ranges(grid, 0), _ranges(grid, 1)
        table = Table(title=caption or None, show_lines=True)
        table.add_column("")
        for lo, hi in cols:
            table.add_column(f"[{lo}:{hi}]", justify="center")
        for r in rows:
            cells = []
            for c in cols:
                devices = grid.get((r, c), [])
                color = colors.setdefault(tuple(devices), _COLORS[len(colors) % len(_COLORS)])
                cells.append(Text(f"devices {','.join(map(str, devices))}", style=color))
            table.add_row("" if len(shape) == 1 else f"[{r[0]}:{r[1]}]", *cells)
        console.print(table)
    if show:
        Console().print(Text.from_ansi(console.export_text(styles=True, clear=False)))
    return console.export_text()


def _png(path: str, title: str, shape, blocks: Blocks) -> None:
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        raise ImportError("gspmd.visualize(png=...) needs the optional package matplotlib: "
                          "pip install 'gspmd[viz]'") from None
    grids = _grids(shape, blocks)
    fig = Figure(figsize=(4 * len(grids), 4))
    FigureCanvasAgg(fig)
    colors: dict[tuple, int] = {}
    palette = list(matplotlib.colormaps["tab20"].colors)
    for i, (caption, grid) in enumerate(grids):
        ax = fig.add_subplot(1, len(grids), i + 1)
        height, width = max(hi for _, hi in _ranges(grid, 0)), max(hi for _, hi in _ranges(grid, 1))
        for ((r0, r1), (c0, c1)), devices in grid.items():
            color = palette[colors.setdefault(tuple(devices), len(colors)) % len(palette)]
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color, edgecolor="black"))
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, ",".join(map(str, devices)), ha="center", va="center", fontsize=8)
        ax.set_xlim(0, width)
        ax.set_ylim(height, 0)
        ax.set_title(caption, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=9)
    fig.savefig(path)
