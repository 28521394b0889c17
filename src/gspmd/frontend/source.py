"""Which line of the user's Python made a jaxpr equation ("train.py:12 (loss)")."""
from __future__ import annotations

import functools
import os

import jax
from jax._src.lib import xla_client

import gspmd

_GSPMD = os.path.dirname(gspmd.__file__) + os.sep
_EXAMPLES = os.path.join(_GSPMD, "models") + os.sep          # case studies count as user code
_LIBRARIES = (os.path.dirname(os.path.dirname(jax.__file__)) + os.sep, f"{os.sep}site-packages{os.sep}",
              f"{os.sep}dist-packages{os.sep}")


@functools.lru_cache(maxsize=4096)    # a traceback has a few dozen frames, over a few files
def _is_user_file(path: str) -> bool:
    if path.startswith(_GSPMD):
        return path.startswith(_EXAMPLES)
    return not any(lib in path or path.startswith(lib) for lib in _LIBRARIES) and not path.startswith("<frozen")


def source_line(eqn) -> str:
    """The innermost frame of the equation's traceback in the user's code (not jax,
    not installed libraries, not gspmd itself); "" when there is none."""
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return ""
    # The raw frames, not .frames: those are made for the whole traceback at each call.
    for code, lasti in zip(*traceback.raw_frames()):
        if _is_user_file(code.co_filename):
            return _line(code, lasti)
    return ""


@functools.lru_cache(maxsize=65536)
def _line(code, lasti: int) -> str:
    line = xla_client.Traceback.code_addr2line(code, lasti)
    return f"{os.path.basename(code.co_filename)}:{line} ({code.co_name})"
