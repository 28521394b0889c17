"""Which line of the user's Python made a jaxpr equation ("train.py:12 (loss)")."""
from __future__ import annotations

import functools
import os

import jax

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
    for frame in (traceback.frames if traceback is not None else ()):
        if _is_user_file(frame.file_name):
            return f"{os.path.basename(frame.file_name)}:{frame.line_num} ({frame.function_name.rsplit('.', 1)[-1]})"
    return ""
