"""The train steps `gspmd plan` lowers: the paper's case studies (and the published runs'
configurations) built from the layers in gspmd.models at any size, on abstract inputs.

Every model's layers are stacked and run by one `lax.scan`, so that planning 128 layers
costs what planning one does. As in the paper, parameters are float32 and activations
bfloat16 (the models' mixed precision); the optimizer is the paper's Adafactor unless
--optimizer says otherwise (sgd, adamw). Each model says which sizes it understands
(ModelSpec.defaults); planning.build rejects any other.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gspmd.errors import ShardingError
from gspmd.frontend.trace import RERUN_SCOPE
from gspmd.mesh import Mesh
from gspmd.models import conformer, moe, optimizers, transformer, unet
from gspmd.pipeline import SCHEDULES, pipeline_loss
from gspmd.spmd.cost import Hardware, device_mesh


@dataclass
class Case:
    """A train step ready to lower: its abstract arguments, mesh and what it is."""
    description: str
    step: Callable
    args: tuple
    mesh: Optional[Mesh]     # None: the meshes the function's annotations name
    sizes: dict
    donate: tuple[int, ...] = ()   # arguments the step updates in place (parameters, optimizer state)


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[dict, Hardware], Case]
    defaults: dict                  # every size the model understands, with its default


# -- shared pieces ------------------------------------------------------------------------
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _mesh(shape: Sequence[int], names: Sequence[str], hw: Hardware) -> Mesh:
    if len(shape) != len(names):
        raise ShardingError(f"--mesh {'x'.join(map(str, shape))} has {len(shape)} dims; this model needs "
                            f"{len(names)} ({'x'.join(n.upper() for n in names)}).")
    return Mesh(device_mesh(shape, hw), names)


def _dtype(sizes: dict):
    if sizes["activation_dtype"] not in DTYPES:
        raise ShardingError(f"--activation-dtype {sizes['activation_dtype']!r}: choose one of {sorted(DTYPES)}.")
    return DTYPES[sizes["activation_dtype"]]


REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")
RERUN = "rerun"   # --remat rerun: rerun_forward


def _policy(name: Optional[str]) -> Optional[Callable]:
    """The jax.checkpoint policy --remat names (None: no rematerialization)."""
    if name is None:
        return None
    if name not in REMAT_POLICIES:
        raise ShardingError(f"--remat {name!r}: choose one of {', '.join(REMAT_POLICIES + (RERUN, 'auto', 'none'))} "
                            "(offload policies move values to host memory, which gspmd does not model).")
    return getattr(jax.checkpoint_policies, name)


def rerun_forward(f: Callable) -> Callable:
    """f, keeping only its inputs for the backward pass, which first reruns f's whole
    forward pass, its output included, as torch.utils.checkpoint does (Megatron-LM's
    --checkpoint-activations). jax.checkpoint recomputes only what the gradient needs:
    not the last matmul's output, which the barrier here keeps."""
    @jax.custom_vjp
    def rerun(*args):
        return f(*args)

    def backward(args, ct):
        args, ct = jax.lax.optimization_barrier((args, ct))   # rerun here, not merged with the forward pass
        with jax.named_scope(RERUN_SCOPE):
            out, pull = jax.vjp(f, *args)
        _, ct = jax.lax.optimization_barrier((out, ct))
        return pull(ct)

    rerun.defvjp(lambda *args: (f(*args), args), backward)
    return rerun


def _remat(name: Optional[str]) -> Callable[[Callable], Callable]:
    """--remat as a wrapper of a layer function: jax.checkpoint with the named saving
    policy (the backward pass recomputes what it does not save), rerun_forward, or none."""
    if name is None:
        return lambda f: f
    if name == RERUN:
        return rerun_forward
    policy = _policy(name)
    return lambda f: jax.checkpoint(f, policy=policy)


def _spec(shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)


def _stack(shapes: dict, *lead: int) -> dict:
    return {name: _spec(lead + tuple(shape)) for name, shape in shapes.items()}


def _cast(params: dict, dtype) -> dict:
    """Weights in the activation dtype, once (the U-Net's; a Megatron pipeline's, whose
    stages would otherwise cast them in every step; the other models cast their own)."""
    return {name: w.astype(dtype) for name, w in params.items()}


OPTIMIZERS = {"sgd": lambda: None, "adamw": optimizers.AdamW, "adafactor": optimizers.Adafactor}


def _train(loss: Callable, params, data: tuple, s: dict, microbatches: int = 1) -> tuple[Callable, tuple]:
    """The train step of loss(params, *data) with the chosen optimizer, and its abstract
    arguments: the parameters, the optimizer's state (none for SGD), the data.
    microbatches > 1: gradient accumulation over data's first two (inputs, targets)."""
    if s["optimizer"] not in OPTIMIZERS:
        raise ShardingError(f"--optimizer {s['optimizer']!r}: choose one of {sorted(OPTIMIZERS)}.")
    optimizer = OPTIMIZERS[s["optimizer"]]()
    step = optimizers.make_step(loss, optimizer, lr=0.01, microbatches=microbatches, batched=2)
    if optimizer is None:
        return step, (params, *data)
    return step, (params, jax.eval_shape(optimizer.init, params), *data)


def _in_place(s: dict) -> tuple[int, ...]:
    """The train step's arguments it updates in place (donated, as the paper's variables
    are): the parameters and the optimizer's state."""
    return (0,) if s["optimizer"] == "sgd" else (0, 1)


def _mse(y, target):
    return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)


def _divide(what: str, total: int, parts: int, by: str) -> int:
    if parts <= 0 or total % parts:
        raise ShardingError(f"{what} {total} does not divide into {parts} ({by}).")
    return total // parts


# -- dense Transformer (Tables 2, 3) and its pipelined form (Table 4) -----------------------
TRANSFORMER = {"layers": 32, "model_dim": 8192, "ffn_dim": 65536, "heads": 128, "head_dim": 256, "seq": 1024,
               "batch": None, "mesh": (32, 64), "stages": None, "microbatches": None, "schedule": "gpipe",
               "repeats": 1, "remat": None, "activation_dtype": "bfloat16", "optimizer": "adafactor", "vocab": None,
               "strategy": "2d", "attention": "dot_product", "dropout": None}
# Table 5's Conformers: 23 M^2 parameters per block; M=2944 makes 32 blocks 6.4B (the paper: 6.47B).
CONFORMER = {**{k: v for k, v in TRANSFORMER.items() if k not in ("vocab", "strategy", "dropout")},
             "layers": 32, "model_dim": 2944, "ffn_dim": 11776, "heads": 23, "head_dim": 128,
             "seq": 768, "mesh": (8, 1), "stages": 8, "microbatches": 16}


@dataclass(frozen=True)
class LayerStack:
    """A model made of identical layers: layer(params, x, annotate, strategy, cfg)."""
    name: str
    layer: Callable
    shapes: Callable[[Any], dict]        # cfg -> {weight name: shape}
    config: Callable[[dict, int], Any]   # (sizes, batch) -> cfg
    strategy: dict                       # annotations by name, over mesh axes x (and y)

    def apply(self, params, x, annotate: Callable, cfg, key=None):
        """One layer on x; with dropout, its masks from `key` (a Conformer layer takes none)."""
        dropping = {} if key is None else {"key": key}
        return self.layer(params, x, annotate, self.strategy, cfg, **dropping)


def _dropout_key(cfg, described: str) -> tuple[tuple, str]:
    """The train step's dropout key argument ((key,), or () without dropout) and the
    description that says so."""
    if not cfg.dropout:
        return (), described
    return (jax.eval_shape(jax.random.key, 0),), f"{described}, dropout {cfg.dropout}"


# --attention: dot_product attends every query at once; flash a block of queries at a time,
# each block recomputed in the backward pass, so that no [B, N, S, S] scores are held, as
# MaxText's attention='flash' kernel holds none (its blocks are 512 queries); megatron all
# at once with the softmax a kernel of its own, as Megatron-LM's fused scale-mask-softmax
# (its dropout and the matmul after it read the probabilities from HBM).
ATTENTION = ("dot_product", "flash", "megatron")
FLASH_BLOCK = 512


def _attention(s: dict) -> str:
    kind = s.get("attention") or "dot_product"
    if kind not in ATTENTION:
        raise ShardingError(f"--attention {kind!r}: choose one of {', '.join(ATTENTION)}.")
    return kind


def _dropout(s: dict) -> float:
    rate = s.get("dropout") or 0.0
    if not 0 <= rate < 1:
        raise ShardingError(f"--dropout {rate}: give a rate in [0, 1), e.g. 0.1 (Megatron-LM's GPT).")
    return rate


def _transformer_config(s: dict, batch: int) -> transformer.Config:
    kind = _attention(s)
    return transformer.Config(batch=batch, seq=s["seq"], model=s["model_dim"], heads=s["heads"],
                              head_dim=s["head_dim"], hidden=s["ffn_dim"], layers=s["layers"], dtype=_dtype(s),
                              attention_block=math.gcd(s["seq"], FLASH_BLOCK) if kind == "flash" else None,
                              dropout=_dropout(s), softmax_kernel=kind == "megatron")


def _layer_shapes(cfg: transformer.Config) -> dict:
    params, _, _ = transformer.example_inputs(dataclasses.replace(cfg, layers=1), abstract=True)
    return {name: v.shape for name, v in params[0].items()}


DENSE = LayerStack("dense Transformer", transformer.layer, _layer_shapes, _transformer_config,
                   transformer.FINALIZED_2D)
CONFORMER_STACK = LayerStack("Conformer", conformer.layer, conformer.shapes,
                             lambda s, batch: conformer.Config(**vars(_transformer_config(s, batch))),
                             {"x": ["x", -1, -1]})   # data parallel inside each stage


def _layer_stack(stack: LayerStack, s: dict, hw: Hardware) -> Case:
    if s["stages"] is not None:
        return _pipelined(stack, s, hw)
    mesh = _mesh(s["mesh"], ("x", "y"), hw)
    batch = s["batch"] or mesh.size // 2
    micro = s["microbatches"] or 1   # without a pipeline: gradient accumulation steps
    mb = _divide("--batch", batch, micro, f"{micro} microbatches of gradient accumulation")
    cfg, dtype, remat = stack.config(s, mb), _dtype(s), _remat(s["remat"])
    annotate = transformer.gspmd_annotate(mesh)

    def layers(stacked, x, key=None):   # with dropout, each layer's masks from its own key
        def body(x, xs):
            p, layer_key = xs
            return stack.apply(p, x, annotate, cfg, layer_key), None
        keys = None if key is None else jax.random.split(key, cfg.layers)
        return jax.lax.scan(remat(body), x, (stacked, keys))[0]

    stacked = _stack(stack.shapes(cfg), cfg.layers)
    described = (f"{stack.name}, {cfg.layers} layers, M={cfg.model} H={cfg.hidden} N={cfg.heads} "
                 f"D={cfg.head_dim}, batch {batch} x seq {cfg.seq}")
    if micro > 1:
        described += f" in {micro} microbatches (gradient accumulation)"
    key, described = _dropout_key(cfg, described)
    if s.get("vocab"):
        tokens = _spec((batch, cfg.seq), jnp.int32)
        params = {"layers": stacked, "embedding": _spec((s["vocab"], cfg.model))}
        vocabulary = Vocabulary(annotate, dtype, EMBEDDINGS[s.get("strategy", "2d")])
        return Case(f"{described}, vocabulary {s['vocab']}",
                    *_train(_language_model_loss(layers, vocabulary), params, (tokens, tokens, *key), s, micro), mesh,
                    {**s, "batch": batch}, donate=_in_place(s))
    act = _spec((batch, cfg.seq, cfg.model), dtype)
    return Case(described, *_train(lambda stacked, x, target, *key: _mse(layers(stacked, x, *key), target), stacked,
                                   (act, act, *key), s, micro),
                mesh, {**s, "batch": batch}, donate=_in_place(s))


# The embedding table [V, M] split as the layers' weights: vocabulary over Y (the model
# parallel axis, as Megatron-LM splits it), M over X (weight-update sharding; not with
# the megatron strategy, which replicates weights over X); the logits [B, S, V] keep B
# over X and V over Y, so the softmax reduces across Y.
EMBEDDING_2D = {"embedding": ["y", "x"], "tokens": ["x", -1], "logits": ["x", -1, "y"]}
EMBEDDINGS = {"2d": EMBEDDING_2D, "megatron": {**EMBEDDING_2D, "embedding": ["y", -1]}}


@dataclass(frozen=True)
class Vocabulary:
    """A language model's ends over one (tied) embedding table: embed (a gather of
    table rows) and the next-token cross-entropy (logits by the same table, log-softmax
    over the vocabulary), laid out as `layout` says."""
    annotate: Callable
    dtype: Any
    layout: dict

    def embed(self, table, tokens):
        table = self.annotate(table, self.layout["embedding"])
        return jnp.take(table, self.annotate(tokens, self.layout["tokens"]), axis=0).astype(self.dtype)

    def loss(self, y, labels, table):
        table = self.annotate(table, self.layout["embedding"])
        logits = self.annotate(jnp.einsum("bsm,vm->bsv", y, table.astype(self.dtype)), self.layout["logits"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, table.shape[0], dtype=logp.dtype) * logp, axis=-1))


def _language_model_loss(layers: Callable, vocabulary: Vocabulary) -> Callable:
    """Tokens in, next-token cross-entropy out: embed, the layer stack, the loss."""
    def loss(params, tokens, labels, *key):
        table = params["embedding"]
        return vocabulary.loss(layers(params["layers"], vocabulary.embed(table, tokens), *key), labels, table)
    return loss


# --strategy: how the layers' weights and activations are split.
STRATEGIES = {"2d": transformer.FINALIZED_2D, "megatron": transformer.MEGATRON}


def _transformer(s: dict, hw: Hardware) -> Case:
    if s["strategy"] not in STRATEGIES:
        raise ShardingError(f"--strategy {s['strategy']!r}: choose one of {sorted(STRATEGIES)} (2d: the paper's "
                            "2D finalized sharding, weights over both axes; megatron: weights over Y only).")
    stack = dataclasses.replace(DENSE, strategy=STRATEGIES[s["strategy"]])
    return _layer_stack(stack, {**s, "stages": s["stages"] or (s["mesh"][0] if len(s["mesh"]) == 3 else None)}, hw)


def remat_refused(name: Optional[str], schedule: Optional[str], repeats: Optional[int]) -> Optional[str]:
    """Why a pipeline with this schedule cannot take --remat `name` (None: it can)."""
    one_f_one_b = schedule == "1f1b"
    if one_f_one_b and name not in (None, "nothing_saveable", RERUN):
        return (f"--remat {name} with --schedule 1f1b: 1F1B's backward slots recompute each layer "
                "from its stashed input (nothing_saveable), or with --remat rerun its whole forward "
                "pass; for a saving policy use --schedule gpipe or circular.")
    if (repeats or 1) > 1 and not one_f_one_b and name == RERUN:
        return ("--remat rerun with a circular schedule (--repeats > 1): the pipeline rematerializes "
                "each step's stage as a whole; rerun each layer with --schedule 1f1b or gpipe.")
    return None


def _pipelined(stack: LayerStack, s: dict, hw: Hardware) -> Case:
    """Stages over the mesh's first axis, data parallel over the second, and (3-D
    meshes) the strategy's model parallelism over the third. With --vocab the first
    stage embeds each microbatch's tokens and the last takes its logits and loss (the
    table tied, its gradient from both ends)."""
    axes = ("p", "x", "y")[:len(s["mesh"])]
    if len(s["mesh"]) < 2 or ("y" not in axes and any("y" in spec for spec in stack.strategy.values())):
        raise ShardingError(f"A pipelined {stack.name} needs a 3-D --mesh LxXxY: L stages, X data parallel, "
                            "Y model parallel.")
    stages = s["stages"]
    if stages != s["mesh"][0]:
        raise ShardingError(f"--stages {stages} must be the mesh's first dim, got --mesh "
                            f"{'x'.join(map(str, s['mesh']))}.")
    if s["schedule"] not in SCHEDULES:
        raise ShardingError(f"--schedule {s['schedule']!r}: choose one of {SCHEDULES}.")
    mesh = _mesh(s["mesh"], axes, hw)
    repeats, micro = s["repeats"], s["microbatches"] or 2 * stages
    batch = s["batch"] or micro * mesh.shape[1]
    per_stage = _divide("--layers", s["layers"], stages * repeats, f"{stages} stages x {repeats} repeats")
    mb = _divide("--batch", batch, micro, f"{micro} microbatches")
    cfg, dtype = stack.config(s, mb), _dtype(s)
    annotate = transformer.gspmd_annotate(mesh)

    # GPipe rematerializes each layer inside its stage. A circular schedule selects a
    # different layer each step: the pipeline rematerializes the step's stage, selection
    # included, so that the layer is not held once per step. 1F1B scans the stage's
    # layers itself: it stashes each layer's input and its backward slots recompute one
    # layer at a time (Megatron-LM's activation memory), as far as its gradient needs or,
    # with --remat rerun, its whole forward pass.
    one_f_one_b = s["schedule"] == "1f1b"
    circular = repeats > 1 and not one_f_one_b
    refused = remat_refused(s["remat"], s["schedule"], repeats)
    if refused:
        raise ShardingError(refused)
    per_layer = None if circular or (one_f_one_b and s["remat"] != RERUN) else s["remat"]
    remat = True if one_f_one_b else (_policy(s["remat"]) or False) if circular else False

    @_remat(per_layer)
    def layer_fn(params, x, key=None):   # with dropout, the pipeline gives each layer of a microbatch a key
        return stack.apply(params, x, annotate, cfg, key)

    def stage_fn(params, x, key=None):
        keys = None if key is None else jax.random.split(key, per_stage)
        return jax.lax.scan(lambda x, p_key: (layer_fn(p_key[0], x, p_key[1]), None), x, (params, keys))[0]

    # Megatron-LM's model holds bfloat16 weights (cast once per step) and sends each tensor
    # rank's share of a stage's output to the next, which gathers it over the tensor axis.
    megatron = s.get("strategy") == "megatron"

    def loss(stacked, microbatches, targets, key=None, ends=None, first_fn=None, loss_fn=_mse):
        return pipeline_loss(layer_fn if one_f_one_b else stage_fn, loss_fn, _cast(stacked, dtype) if megatron
                             else stacked, microbatches, targets, mesh=mesh, stage_axis="p", schedule=s["schedule"],
                             repeats=repeats, stage_major=True, ends=ends, first_fn=first_fn, remat=remat,
                             scan_layers=one_f_one_b, key=key, scatter_axis="y" if megatron else None) / micro

    stacked = _stack(stack.shapes(cfg), stages * repeats, per_stage)
    described = (f"pipelined {stack.name}, {s['layers']} layers over {stages} stages ({s['schedule']}, "
                 f"{repeats} repeats), M={cfg.model} H={cfg.hidden} N={cfg.heads} D={cfg.head_dim}, "
                 f"{micro} microbatches of {mb} x seq {cfg.seq}")
    sizes = {**s, "stages": stages, "microbatches": micro, "batch": batch}
    key, described = _dropout_key(cfg, described)
    if s.get("vocab"):
        vocabulary = Vocabulary(annotate, dtype, EMBEDDINGS[s.get("strategy", "2d")])
        tokens = _spec((micro, mb, cfg.seq), jnp.int32)
        params = {"layers": stacked, "embedding": _spec((s["vocab"], cfg.model))}

        def language_model(params, tokens, labels, key=None):
            return loss(params["layers"], tokens, labels, key, params["embedding"], vocabulary.embed,
                        vocabulary.loss)
        return Case(f"{described}, vocabulary {s['vocab']}",
                    *_train(language_model, params, (tokens, tokens, *key), s), mesh, sizes, donate=_in_place(s))
    data = _spec((micro, mb, cfg.seq, cfg.model), dtype)
    return Case(described, *_train(loss, stacked, (data, data, *key), s), mesh, sizes, donate=_in_place(s))


# -- mixture of experts (Table 6) and hybrid sparse/dense (Table 7) -------------------------
MOE = {"layers": 16, "model_dim": 2048, "ffn_dim": 8192, "heads": 16, "head_dim": 128, "seq": 1024,
       "experts": None, "batch": None, "mesh": None, "remat": None, "activation_dtype": "bfloat16",
       "optimizer": "adafactor"}
HYBRID = {**MOE, "layers": 24, "model_dim": 4096, "ffn_dim": 32768, "heads": 128, "head_dim": 128,
          "mesh": (8, 4)}


def _moe_transformer(s: dict, hw: Hardware, hybrid: bool) -> Case:
    """Layers in pairs: a dense Transformer layer (attention + feed-forward), then a
    mixture-of-experts feed-forward layer (top-1 gating, capacity 2 x seq / experts)."""
    if hybrid:
        mesh = _mesh(s["mesh"] or (8, 4), ("x", "y"), hw)
        dense_strategy, expert_axis = transformer.FINALIZED_2D, "y"
    else:
        shape = s["mesh"] or (s["experts"] or 32,)
        mesh = _mesh(shape, ("x",), hw)
        dense_strategy = {"x": ["x", -1, -1]}    # data parallel; experts split over the same axis
        expert_axis = None
    experts = s["experts"] or mesh.shape[0]
    if experts % mesh.shape[0]:
        raise ShardingError(f"--experts {experts} must be a multiple of the expert axis ({mesh.shape[0]}).")
    batch = s["batch"] or 4 * mesh.shape[0]
    pairs = _divide("--layers", s["layers"], 2, "dense and MoE layers alternate")
    dtype, remat = _dtype(s), _remat(s["remat"])
    cfg = _transformer_config({**s, "layers": pairs}, batch)
    mcfg = moe.Config(groups=batch, group_size=s["seq"], model=s["model_dim"], hidden=s["ffn_dim"],
                      experts=experts, capacity=max(1, math.ceil(2 * s["seq"] / experts)), dtype=dtype)
    annotate = transformer.gspmd_annotate(mesh)

    def loss(stacked, x, target):
        def body(x, p):
            dense, sparse = p
            x = transformer.layer(dense, x, annotate, dense_strategy, cfg)
            return moe.moe_layer(sparse, x, mesh, "x", mcfg, expert_axis).astype(dtype), None
        y, _ = jax.lax.scan(remat(body), x, stacked)
        return _mse(y, target)

    expert_shapes = {"w_gate": (mcfg.model, experts), "w_in": (experts, mcfg.model, mcfg.hidden),
                     "w_out": (experts, mcfg.hidden, mcfg.model)}
    stacked = (_stack(_layer_shapes(cfg), pairs), _stack(expert_shapes, pairs))
    act = _spec((batch, s["seq"], s["model_dim"]), dtype)
    kind = "hybrid sparse/dense MoE (experts over X, expert-internal H over Y)" if hybrid else \
        "MoE Transformer (experts and batch over one axis)"
    return Case(f"{kind}, {s['layers']} layers ({pairs} MoE), {experts} experts, M={s['model_dim']} "
                f"H={s['ffn_dim']} N={s['heads']} D={s['head_dim']}, batch {batch} x seq {s['seq']}",
                *_train(loss, stacked, (act, act), s), mesh, {**s, "experts": experts, "batch": batch,
                                                        "mesh": tuple(mesh.shape)}, donate=_in_place(s))


# -- 3D U-Net (Table 8) ---------------------------------------------------------------------
UNET = {"image_size": 128, "batch": 4, "mesh": (1, 16), "model_dim": 128, "remat": None,
        "activation_dtype": "bfloat16", "optimizer": "sgd"}


def _unet(s: dict, hw: Hardware) -> Case:
    """Mesh (data, spatial): batch over the first axis, image depth over the second.
    --model-dim is the width of the first convolution (the model doubles it once);
    --remat: the whole forward pass under jax.checkpoint with that policy (or rerun)."""
    mesh = _mesh(s["mesh"], ("data", "spatial"), hw)
    dtype, size, width = _dtype(s), s["image_size"], s["model_dim"]
    params = {name: _spec(w.shape) for name, w in unet.init_params(np.random.RandomState(0), 1, width).items()}

    def forward(params, x):
        return unet.forward(_cast(params, dtype), x, mesh, ("spatial", -1, -1), batch_axis="data")
    forward = _remat(s["remat"])(forward)

    def loss(params, x, y):
        return _mse(forward(params, x), y)

    image = _spec((s["batch"], 1, size, size, size), dtype)
    return Case(f"3D U-Net, width {width}, batch {s['batch']} of {size}^3 images",
                *_train(loss, params, (image, image), s), mesh, s, donate=_in_place(s))


MODELS = {
    "transformer": ModelSpec(_transformer, TRANSFORMER),
    "moe": ModelSpec(lambda s, hw: _moe_transformer(s, hw, hybrid=False), MOE),
    "hybrid-moe": ModelSpec(lambda s, hw: _moe_transformer(s, hw, hybrid=True), HYBRID),
    "unet": ModelSpec(_unet, UNET),
    "conformer": ModelSpec(lambda s, hw: _layer_stack(CONFORMER_STACK, s, hw), CONFORMER),
}
