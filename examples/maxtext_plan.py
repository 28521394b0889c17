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

`search(devices, hardware, **overrides)` chooses MaxText's own knobs for the model the
overrides describe, keeping its global batch (per_device_batch_size x devices):

    python examples/maxtext_plan.py --devices 256 --hardware tpu-v5p global_parameter_scale=128 \
        per_device_batch_size=1 attention=flash

prints the ici_fsdp_parallelism, ici_tensor_parallelism and remat_policy words to add to
MaxText's command line, with the plans behind them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import jax
from flax.linen import partitioning as nn_partitioning
from maxtext.configs import pyconfig
from maxtext.trainers.pre_train import train, train_compile
from maxtext.utils import maxtext_utils, sharding
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

import gspmd
from gspmd import plan_search, planning

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


# MaxText's remat_policy names with a jax.checkpoint policy of our Transformer recipe, least recompute first
REMAT = {"minimal": "dots_with_no_batch_dims_saveable", "full": "nothing_saveable"}
KNOBS = ("ici_fsdp_parallelism", "ici_tensor_parallelism", "remat_policy")


def recipe_sizes(config) -> planning.Sizes:
    """MaxText's model as our Transformer recipe's sizes (what ranks the knobs): its
    dims, global batch and attention; its gated MLP as a plain one of as many weights."""
    return planning.Sizes(layers=config.num_decoder_layers, model_dim=config.emb_dim, ffn_dim=3 * config.mlp_dim // 2,
                          heads=config.num_query_heads, head_dim=config.head_dim, seq=config.max_target_length,
                          vocab=config.vocab_size, batch=config.global_batch_size_to_train_on, optimizer="adamw",
                          strategy="2d", attention="flash" if config.attention == "flash" else "dot_product")


@dataclasses.dataclass
class Choice:
    knobs: dict                 # MaxText's words: its ici_* parallelism and remat_policy
    report: object              # gspmd's report of MaxText's own step with them

    def words(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.knobs.items())


def search(devices: int, hardware: str = "tpu-v5p", budget_s: float = 60.0, verify: int = 3,
           **overrides) -> tuple[Choice, list[Choice]]:
    """MaxText's knobs (FSDP x tensor parallelism, remat policy) for the model `overrides`
    describe over `devices` devices, its global batch kept: our recipe's search
    (plan_search, over the meshes and policies those knobs reach) ranks them, the best
    `verify` and MaxText's defaults are planned with MaxText's own step, and the fastest
    that fits is chosen. Returns (the choice, every plan of MaxText's step made)."""
    config = config_of(devices, overrides)
    names = {policy: name for name, policy in REMAT.items()}
    ranked = plan_search.search("transformer", recipe_sizes(config), devices, hardware, budget_s,
                                remat_choices=tuple(REMAT.values()),
                                keep=lambda c: not c.pipelined and not c.microbatches and len(c.mesh) == 2)
    tried = [{}]      # MaxText's defaults first: the answer is never worse than them
    for c in ranked.verified[:verify]:
        tried.append(dict(ici_fsdp_parallelism=c.config.mesh[0], ici_tensor_parallelism=c.config.mesh[1],
                          ici_data_parallelism=1, remat_policy=names[c.plan.case.sizes["remat"]]))
    plans = []
    for knobs in tried:
        step, args, donate = make(devices, hardware, **{**overrides, **knobs})
        report = gspmd.jit(step, hardware=hardware, donate_argnums=donate).lower(*args).report()
        plans.append(Choice(knobs or {k: getattr(config, k) for k in KNOBS}, report))
    best = min(plans, key=lambda p: (not p.report.fits_in_memory, p.report.step_seconds))
    return best, plans


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="MaxText's ici_* parallelism and remat_policy for a model, "
                                                 "searched by gspmd")
    parser.add_argument("overrides", nargs="*", help="MaxText's key=value words: the model and batch")
    parser.add_argument("--devices", type=int, default=256)
    parser.add_argument("--hardware", default="tpu-v5p")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of the recipe search")
    parser.add_argument("--verify", type=int, default=3, help="how many of its best to plan with MaxText's step")
    args = parser.parse_args(argv)
    best, plans = search(args.devices, args.hardware, args.budget, args.verify,
                         **dict(w.split("=", 1) for w in args.overrides))
    for p in plans:
        r = p.report
        print(f"{p.words()}: step {r.step_seconds:.3f} s, peak {r.peak_memory_bytes / 1e9:.1f} GB"
              f"{'' if r.fits_in_memory else ' (does NOT fit)'}")
    print(f"chosen: {best.words()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
