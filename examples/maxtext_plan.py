"""MaxText's own train step, planned with `gspmd plan` on abstract inputs at any size:

    gspmd plan examples/maxtext_plan.py:make --devices 256 --hardware tpu-v5p
    MAXTEXT_OVERRIDES="global_parameter_scale=128 per_device_batch_size=1 ici_tensor_parallelism=8 \\
        remat_policy=minimal" gspmd plan examples/maxtext_plan.py:make --devices 256 --hardware tpu-v5p

`make(devices, hardware, **overrides)` is a factory (see `gspmd plan --help`). It builds
MaxText's config as its train script does (pyconfig over base.yml with `key=value`
overrides: MAXTEXT_OVERRIDES, words as on MaxText's command line, then the keyword
arguments), its 12-axis mesh for that many devices, and the step and abstract inputs
MaxText's ahead-of-time compiler (train_compile) makes: the train state from
jax.eval_shape of its init, laid out by its logical axis rules, the batch over its data
axes; nothing of the model's size is allocated. MaxText runs unchanged (needs Python >=
3.12); what it would ask of real devices is answered on our side:

- the device count: pyconfig's `internal_compile_num_devices` (what train_compile uses
  for topologies it has no table for);
- the mesh: MaxText's create_device_mesh picks the shape (its ici_* parallelism) over
  stand-in devices (gspmd.planning.StandInDevice, as jax.experimental.topologies' are
  for ahead-of-time compilation), laid out on the hardware's network as jax's
  mesh_utils lays out TPU slices (gspmd.planning.device_mesh);
- attention: `attention=dot_product` unless overridden; with `attention=flash`, or a
  mixture of experts with megablox, on a TPU profile the stand-in devices say they are
  TPUs, so that MaxText runs its Pallas kernels (splash attention, grouped matmuls, in
  shard_maps), which gspmd plans as kernels of their own (such a plan cannot run on this
  machine); no checkpoints, synthetic data, no distributed system.
"""
from __future__ import annotations

import os
import tempfile

import jax
from flax.linen import partitioning as nn_partitioning
from maxtext.configs import pyconfig
from maxtext.trainers.pre_train import train, train_compile
from maxtext.utils import maxtext_utils, sharding
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

import gspmd
from gspmd import planning

# What planning on abstract inputs needs of MaxText's config (any of it may be overridden).
PLANNING = dict(attention="dot_product", dataset_type="synthetic", enable_checkpointing=False,
                skip_jax_distributed_system=True, enable_goodput_recording=False, steps=1, run_name="gspmd-plan")


def config_of(devices: int, overrides: dict):
    """MaxText's config for `devices` devices: base.yml, PLANNING, MAXTEXT_OVERRIDES,
    then `overrides`."""
    words = [w for w in os.environ.get("MAXTEXT_OVERRIDES", "").split() if w]
    bad = [w for w in words if "=" not in w]
    if bad:
        raise gspmd.ShardingError(f"MAXTEXT_OVERRIDES holds {bad}: give key=value words, as on MaxText's command "
                                  "line, e.g. MAXTEXT_OVERRIDES='global_parameter_scale=128 remat_policy=minimal'.")
    given = {**PLANNING, "base_output_directory": tempfile.gettempdir(), **dict(w.split("=", 1) for w in words),
             **overrides, "internal_compile": True, "internal_compile_num_devices": devices}
    return pyconfig.initialize(["", os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")]
                               + [f"{k}={v}" for k, v in given.items()])


def mesh_of(config, devices: int, hardware: str) -> jax.sharding.Mesh:
    """MaxText's mesh (its axes, the shape its create_device_mesh picks) over stand-in
    devices laid out on `hardware`'s network; TPU devices where MaxText is to run its
    TPU kernels (Pallas kernels in shard_maps, which it picks by the mesh's platform)."""
    shape = maxtext_utils.create_device_mesh(config, planning.stand_in_devices(devices)).shape
    platform = "tpu" if hardware.startswith("tpu") and _runs_tpu_kernels(config) else "cpu"
    return planning.stand_in_mesh(shape, tuple(config.mesh_axes), hardware, platform=platform)


def _runs_tpu_kernels(config) -> bool:
    """Whether MaxText runs Pallas kernels on a TPU for this config: flash attention
    (splash), or a mixture of experts' grouped matmuls (megablox; base.yml's default)."""
    return config.attention == "flash" or (config.num_experts > 1 and config.sparse_matmul and config.megablox)


def make(devices: int = 256, hardware: str = "tpu-v5p", **overrides):
    """(MaxText's train step, its abstract arguments, the argument it updates in place)
    for `devices` devices of `hardware`."""
    config = config_of(devices, overrides)
    mesh = mesh_of(config, devices, hardware)
    (state, batch), _, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    fn, _, (out_state_shardings, _), _, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, sharding.get_input_data_sharding(config, mesh),
        sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings),
        model, config, params_shardings)

    def train_step(state, batch):
        """MaxText's step under its logical axis rules, as its train loop runs it (the
        arguments bring their layouts; the new state goes out in the state's)."""
        with nn_partitioning.axis_rules(config.logical_axis_rules):
            new_state, metrics = fn(state, batch)
        return jax.lax.with_sharding_constraint(new_state, out_state_shardings), metrics
    train_step.__name__ = f"maxtext_train_step[{config.model_name}, scale {config.global_parameter_scale}]"
    return train_step, (state, batch), (donate,)
