"""Plans of the paper's case studies at any size, and of a user's own function, on
abstract inputs: no execution, no accelerator (what `gspmd plan` runs). The models'
train steps are built in gspmd.recipes; a user's function comes as module:function.
Each model says which sizes it understands; a size it does not is an error, never
silently ignored.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

from gspmd.api import Lowered, jit
from gspmd.analysis import Report
from gspmd.errors import ShardingError
from gspmd.recipes import MODELS, Case, remat_refused
from gspmd.spmd.cost import Hardware, device_mesh, profile

__all__ = ["Sizes", "CasePlan", "plan", "plan_to_fit", "build", "FIT_ORDER", "device_mesh", "profile",
           "StandInDevice", "stand_in_devices", "stand_in_mesh"]


@dataclass(frozen=True)
class Sizes:
    """The sizes the paper's tables vary (None: the model's default)."""
    layers: Optional[int] = None
    model_dim: Optional[int] = None
    ffn_dim: Optional[int] = None
    heads: Optional[int] = None
    head_dim: Optional[int] = None
    seq: Optional[int] = None
    vocab: Optional[int] = None
    experts: Optional[int] = None
    batch: Optional[int] = None
    mesh: Optional[tuple[int, ...]] = None
    stages: Optional[int] = None
    microbatches: Optional[int] = None
    schedule: Optional[str] = None
    repeats: Optional[int] = None
    image_size: Optional[int] = None
    remat: Optional[str] = None
    activation_dtype: Optional[str] = None
    optimizer: Optional[str] = None
    strategy: Optional[str] = None
    attention: Optional[str] = None
    dropout: Optional[float] = None
    devices: Optional[int] = None    # a user function's factory: how many devices to plan for

    def given(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclass
class CasePlan:
    """A case study lowered at its sizes and reported (what `gspmd plan` prints);
    gspmd.Plan is gspmd.auto's proposal of annotations, another thing."""
    case: Case
    lowered: Lowered
    report: Report
    planning_seconds: float
    # --remat auto: each policy tried, least recompute first, with its peak per device
    remat_tried: list[tuple[Optional[str], int]] = dataclasses.field(default_factory=list)

    def as_json(self, top: int = 10) -> dict:
        """The plan's figures; `top`: how many of the largest buffers at the peak to list."""
        r = self.report
        # a user function's: the first mesh its annotations or arguments name
        mesh = self.case.mesh if self.case.mesh is not None else self.lowered.mesh
        return {"model": self.case.description, "sizes": {k: v for k, v in self.case.sizes.items() if v is not None},
                "mesh": dict(zip(mesh.axis_names, map(int, mesh.shape))),
                "devices": int(self.lowered.num_devices), "hardware": r.hardware.name,
                "planning_seconds": self.planning_seconds,
                "peak_memory_bytes": int(r.peak_memory_bytes), "fits_in_memory": r.fits_in_memory,
                "remat_tried": [{"remat": policy, "peak_memory_bytes": peak} for policy, peak in self.remat_tried],
                "flops_per_device": int(r.flops), "memory_bound_flops_per_device": int(r.memory_bound_flops),
                "step_seconds": r.step_seconds, "compute_seconds": r.compute_seconds,
                "communication_seconds": r.communication_seconds,
                "exposed_communication_seconds": r.exposed_communication_seconds,
                "flops_utilization": r.flops_utilization, "effective_utilization": r.effective_utilization,
                "bubble_fraction": r.bubble_fraction, "recompute_fraction": r.recompute_fraction,
                "collectives": {kind: {"count": n, "bytes_per_device": sum(
                    c.bytes * c.executions for c in r.collectives if c.kind == kind)}
                    for kind, n in sorted(_executions(r).items())},
                "largest_buffers_at_peak": [
                    {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes, "kind": t.kind,
                     "sharding": None if t.sharding is None else str(t.sharding), "made_by": t.origin,
                     "source": t.source, "in_loop": t.where} for t in r.memory.top(top)]}


def _executions(report: Report) -> dict:
    counts: dict = {}
    for c in report.collectives:
        counts[c.kind] = counts.get(c.kind, 0) + c.executions
    return counts


def plan(model: str, sizes: Sizes = Sizes(), hardware: Union[str, Hardware] = "tpu-v3",
         fit_memory: bool = True) -> CasePlan:
    """Lower `model` ("transformer", "moe", "hybrid-moe", "unet", "conformer" or
    "module:function") at `sizes` and report it on `hardware`. sizes.remat "auto": the
    least rematerialization that fits the hardware's memory (see plan_to_fit).
    fit_memory=False: as partitioned, nothing gathered or computed again to fit."""
    if sizes.remat == "auto":
        return plan_to_fit(model, sizes, hardware)
    hw = profile(hardware)
    start = time.perf_counter()
    case = build(model, sizes, hw)
    lowered = jit(case.step, mesh=case.mesh, hardware=hw, donate_argnums=case.donate,
                  memory_limit=None if fit_memory else NO_LIMIT).lower(*case.args)
    return CasePlan(case, lowered, lowered.report(), time.perf_counter() - start)


NO_LIMIT = 2 ** 62   # bytes: a memory limit no program reaches
# Rematerialization from the least recompute to the most: what --remat auto tries.
FIT_ORDER = (None, "dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable")


def plan_to_fit(model: str, sizes: Sizes = Sizes(), hardware: Union[str, Hardware] = "tpu-v3",
                policies: Sequence[Optional[str]] = FIT_ORDER) -> CasePlan:
    """The plan with the first of `policies` (--remat values, None: no rematerialization)
    whose peak fits the hardware's memory; the last one's if none does. Policies the
    schedule refuses (a saving policy under 1F1B) are passed over. Its sizes say which
    was chosen, remat_tried what each tried one held; its planning time counts them all."""
    start = time.perf_counter()
    tried = []
    allowed = [p for p in policies if remat_refused(p, sizes.schedule, sizes.repeats) is None]
    if not allowed:
        raise ShardingError(remat_refused(policies[0], sizes.schedule, sizes.repeats))
    for policy in allowed:
        chosen = plan(model, dataclasses.replace(sizes, remat=policy), hardware)
        tried.append((policy, int(chosen.report.peak_memory_bytes)))
        if chosen.report.fits_in_memory:
            break
    chosen.planning_seconds = time.perf_counter() - start
    chosen.remat_tried = tried
    return chosen


def build(model: str, sizes: Sizes, hw: Hardware) -> Case:
    if ":" in model:
        unknown = set(sizes.given()) - {"devices"}
        if unknown:
            raise ShardingError(f"Sizes {sorted(unknown)} do not apply to a user function ({model}): its "
                                "plan_args() (or its factory) gives its inputs and its annotations its meshes.")
        return _user_function(model, hw, sizes.devices)
    if sizes.devices is not None:
        raise ShardingError(f"{model}: give --mesh (or --devices on the command line, which makes one).")
    if model not in MODELS:
        raise ShardingError(f"Unknown model {model!r}; choose one of {sorted(MODELS)} or module:function.")
    spec = MODELS[model]
    unknown = set(sizes.given()) - set(spec.defaults)
    if unknown:
        raise ShardingError(f"{model} does not vary {', '.join(sorted('--' + u.replace('_', '-') for u in unknown))}"
                            f"; its sizes are {', '.join('--' + k.replace('_', '-') for k in spec.defaults)}.")
    resolved = {**spec.defaults, **sizes.given()}
    return spec.build(resolved, hw)


# -- hardware this process has not -----------------------------------------------------------
@dataclass(frozen=True)
class StandInDevice:
    """A device of hardware this process has not, for a jax.sharding.Mesh to plan on (as
    jax.experimental.topologies' devices are for ahead-of-time compilation): what library
    code reads of a device (id, platform, kind, process), nothing to run on. gspmd.jit
    lowers and reports over a mesh of them; calling it there is an error. Its platform
    is "cpu" so that libraries that pick kernels by platform take their portable path,
    unless a plan asks for the hardware's own ("tpu": its Pallas kernels, which plan)."""
    id: int
    platform: str = "cpu"
    device_kind: str = "stand-in"
    process_index: int = 0


def stand_in_devices(n: int, platform: str = "cpu") -> list[StandInDevice]:
    return [StandInDevice(i, platform=platform) for i in range(n)]


def stand_in_mesh(shape: Sequence[int], axis_names: Sequence[str],
                  hardware: Union[str, Hardware] = "tpu-v3", platform: str = "cpu") -> jax.sharding.Mesh:
    """A jax mesh of stand-in devices of this shape, laid out on `hardware`'s network
    (device_mesh: each axis along whole dims of it, as jax's mesh_utils for TPU slices).
    platform="tpu": libraries that pick kernels by the mesh's platform take their TPU
    path (Pallas kernels in shard_maps, which plan; the sim backend runs none of them)."""
    devices = np.array(stand_in_devices(int(np.prod(shape)), platform), dtype=object)
    return jax.sharding.Mesh(devices[device_mesh(shape, hardware)], tuple(axis_names))


# -- a user's function ------------------------------------------------------------------------
USER_FUNCTION = """module:function (module: a dotted name on sys.path, or a path to a .py file) is
either a function whose module also defines plan_args(), its arguments (jax.ShapeDtypeStruct
or arrays); or, in a module without plan_args, a factory: function(devices=N) (called
without arguments when no --devices is given; given hardware=NAME too, the --hardware
profile, where it takes a hardware parameter) returning (step, args), the function to plan
and its arguments, or (step, args, donate), donate the indices of the arguments the step
updates in place. The function's annotations (or its arguments' NamedShardings) name its
meshes."""


def _user_function(spec: str, hw: Hardware, devices: Optional[int] = None) -> Case:
    """`module:function`, as USER_FUNCTION says."""
    module_name, _, fn_name = spec.rpartition(":")
    module = _import(module_name, spec)
    fn: Any = getattr(module, fn_name, None)
    if not callable(fn):
        raise ShardingError(f"Module {module_name} has no function {fn_name!r}.")
    make_args = getattr(module, "plan_args", None)
    if callable(make_args):
        if devices is not None:
            raise ShardingError(f"--devices applies to a factory (a module without plan_args()); {module_name}'s "
                                f"plan_args() gives {fn_name}'s arguments and its annotations their meshes.")
        return Case(spec, fn, tuple(make_args()), None, {})
    given = {} if devices is None else {"devices": devices}
    if "hardware" in _parameters(fn):
        given["hardware"] = hw.name
    try:
        made = fn(**given)
    except TypeError as e:
        raise ShardingError(f"{spec}: module {module_name} must define plan_args() returning the arguments of "
                            f"{fn_name}, or {fn_name} must be a factory, {fn_name}(devices=N) -> (step, args), "
                            f"for `gspmd plan|auto {spec}` ({e}).") from None
    if not (isinstance(made, tuple) and len(made) in (2, 3) and callable(made[0])):
        raise ShardingError(f"{spec}: a factory returns (step, args) or (step, args, donate): the function to plan, "
                            f"a tuple of its arguments, the indices of those it updates in place; got "
                            f"{type(made).__name__}.")
    step, args, donate = made if len(made) == 3 else (*made, ())
    return Case(f"{spec}({'' if devices is None else f'devices={devices}'})", step, tuple(args), None,
                {} if devices is None else {"devices": devices}, tuple(donate))


def _parameters(fn) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):     # a builtin or C function: no signature to read
        return ()


def _import(module_name: str, spec: str):
    """A dotted module name, or a path to a .py file."""
    try:
        if module_name.endswith(".py"):
            path = pathlib.Path(module_name)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[path.stem] = module      # dataclasses and pickling look their module up here
            loader.loader.exec_module(module)
            return module
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ShardingError(f"Cannot import module {module_name!r} for {spec}: {e}.") from None
