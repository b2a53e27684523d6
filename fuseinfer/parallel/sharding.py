"""Tensor parallel for OPT over ``torch.distributed`` (NCCL on GPUs, gloo on CPU), Megatron's layout:

* q/k/v and fc1 split by columns (output features; each rank keeps H/tp heads and ffn/tp hidden units),
  out_proj and fc2 by rows (input features), so each block needs one all-reduce: after out_proj and after fc2.
  The bias of a row-parallel linear, and the residual fused into its epilogue, are added on rank 0 only (other
  ranks hold no such bias), so the all-reduce's sum adds them once.
* embeddings, LayerNorms and the LM head are replicated (the LM head: OPT ties it to the input embeddings, and
  its 50272 x E read is ~1.4% of a decode step's weights per GPU at OPT-66b and TP=2; sharding it by vocabulary
  would add an all-gather of the logits to every step for that).
* the patched modules' own forwards run on the shards (num_heads and the projections' widths are per rank; the
  fused q/k/v buffer is built from the rank's q/k/v rows), subclassed here to add the all-reduce.

Why not transformers' ``tp_plan`` / ``DistributedConfig``: OPT's config has no ``base_model_tp_plan`` in
transformers 5.x, and that path shards through DTensor-wrapped nn.Linear forwards, which the fused modules bypass
(they read the weights); here the shards are plain tensors the fused kernels take as they are.

Fast decode captures the per-op step, NCCL all-reduces included, into a CUDA graph on each rank; the one-kernel
step (``fuseinfer::opt_decode_step``) has no all-reduce between its phases and is not used. Every rank computes
the same tokens (the LM head's input is the all-reduce's result, identical on every rank; ``init_distributed``
seeds every rank alike for sampling), so ``model.generate`` returns the same tokens on every rank.

``tensor_parallel`` is one-way: the other ranks' slices are not kept (that is the memory it saves).
``fuseinfer.unpatch`` leaves the sharded model with unfused tensor-parallel modules (still correct).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.models.opt.modeling_opt import OPTAttention, OPTDecoderLayer

from fuseinfer.core.errors import FuseInferError
from fuseinfer.models.opt.modules import FusedOPTAttention, FusedOPTDecoderLayer, _original_forward
from fuseinfer.core import placement
from fuseinfer.parallel.dist import gather_errors
from fuseinfer.harness.materialize import Init, materialize

from fuseinfer.core.decode_plan import TP_ATTR, tp_info  # noqa: F401 (re-exported)
_COLUMN = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkv]_proj|fc1)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.out_proj|fc2)\.(weight|bias)$")


@dataclass(frozen=True, eq=False)
class TPInfo:
    """This rank's place: rank and size in ``group`` (None: the default group)."""

    rank: int
    size: int
    group: object = None

    def __deepcopy__(self, memo):  # a process group cannot be copied; a copy of the model shares it
        return self


def _reduce(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Sum ``out`` over the ranks, in place (one NCCL all-reduce on the current stream: CUDA-graph capturable)."""
    dist.all_reduce(out, group=module._fuseinfer_tp.group)
    return out


def _rank0(module: nn.Module, residual):
    """The residual to add on this rank: rank 0 adds it, the others add nothing (the all-reduce sums them)."""
    return residual if module._fuseinfer_tp.rank == 0 else None


def _eval_only(module: nn.Module, x: torch.Tensor) -> None:
    if _original_forward(module, x):
        raise FuseInferError("a tensor-parallel OPT layer runs in eval mode, without autocast to another dtype and "
                             "without global module hooks (those run the original forward, which has no all-reduce "
                             "after fc2): call model.eval() and run in the model's dtype")


class TPOPTAttention(OPTAttention):
    """OPTAttention over this rank's heads; out_proj's partial sums all-reduced (its bias on rank 0 only)."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return _reduce(self, out), weights


class TPFusedOPTAttention(FusedOPTAttention):
    """FusedOPTAttention over this rank's heads; the residual rides in rank 0's out_proj epilogue, then one
    all-reduce gives every rank out_proj(attention) + bias + residual."""

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, output_attentions=False,
                residual=None, **kwargs):
        out, weights = super().forward(hidden_states, past_key_values, attention_mask, output_attentions,
                                       residual=_rank0(self, residual), **kwargs)
        return _reduce(self, out), weights


class TPFusedOPTDecoderLayer(FusedOPTDecoderLayer):
    """FusedOPTDecoderLayer over this rank's ffn units: fc2's partial sums (+ bias + residual on rank 0)
    all-reduced."""

    def forward(self, hidden_states, *args, **kwargs):
        _eval_only(self, hidden_states)
        return super().forward(hidden_states, *args, **kwargs)

    def _mlp(self, x, residual):
        return _reduce(self, super()._mlp(x, _rank0(self, residual)))


class TPOPTDecoderLayer(OPTDecoderLayer):
    """What ``fuseinfer.unpatch`` leaves of a TPFusedOPTDecoderLayer (or what a layer ``patch`` skipped becomes):
    OPT's layer op by op (the fused layer's code path with no fused op), with the all-reduce after fc2."""

    _fuseinfer_ops = frozenset()

    def forward(self, hidden_states, *args, **kwargs):
        _eval_only(self, hidden_states)
        return FusedOPTDecoderLayer.forward(self, hidden_states, *args, **kwargs)

    def _mlp(self, x, residual):
        return _reduce(self, FusedOPTDecoderLayer._mlp(self, x, _rank0(self, residual)))


_FUSED_TP = {FusedOPTAttention: TPFusedOPTAttention, FusedOPTDecoderLayer: TPFusedOPTDecoderLayer,
             OPTAttention: TPOPTAttention, OPTDecoderLayer: TPOPTDecoderLayer}
_UNFUSED_TP = {OPTAttention: TPOPTAttention, OPTDecoderLayer: TPOPTDecoderLayer}


def _config_hash(model: nn.Module, size: int) -> str:
    """What every rank must agree on: the config (less its path and transformers version), dtype and TP size."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    dtype = next(model.parameters()).dtype
    text = json.dumps(cfg, sort_keys=True, default=str) + f"|{dtype}|tp={size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _local_error(model, size: int, tp_size, device: torch.device, backend: str, init) -> str | None:
    """The first problem with this rank's input, or None (checked before any collective, on every rank)."""
    from fuseinfer.core.state import patch_state

    if type(model).__name__ != "OPTForCausalLM":
        return f"tensor_parallel takes an OPTForCausalLM, got {type(model).__name__}"
    if tp_info(model) is not None:
        return "this model is already tensor-parallel (tensor_parallel is one-way: reload the model to change it)"
    if patch_state(model) is not None:
        return "tensor_parallel patches the model itself: pass the unpatched model (fuseinfer.unpatch(model) first)"
    if placement.is_hooked(model):
        return ("the model is dispatched by accelerate (device_map / dispatch_model): tensor_parallel needs the whole "
                "model on one device, or on the meta device: load it without device_map (or device_map='cpu'), or "
                "on meta with an init, and let tensor_parallel place each rank's shard")
    if tp_size is not None and tp_size != size:
        return (f"tp_size={tp_size} but the process group has {size} rank(s): launch torchrun --nproc-per-node "
                f"{tp_size}, or pass group= a process group of {tp_size} ranks")
    cfg = model.config
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("ffn_dim", cfg.ffn_dim)):
        if n % size:
            return (f"{what}={n} is not divisible by the tensor-parallel size {size}: heads (and ffn units) are split "
                    f"evenly; use a tp size from {[d for d in _divisors(n) if cfg.ffn_dim % d == 0 and cfg.num_attention_heads % d == 0]}")
    if device.type == "cuda":
        if backend != "nccl":
            return (f"tensor_parallel on CUDA needs the NCCL backend, the process group uses {backend!r} (NCCL is "
                    f"{'available' if dist.is_nccl_available() else 'not available in this torch build'}): "
                    "fuseinfer.parallel.init_distributed() picks NCCL when a GPU is visible")
        if size > torch.cuda.device_count():
            return (f"tensor-parallel size {size} is larger than the {torch.cuda.device_count()} visible GPU(s): "
                    f"one GPU per rank (torchrun --nproc-per-node {torch.cuda.device_count()} at most)")
    elif backend == "nccl":
        return "the process group uses NCCL, which needs CUDA tensors: pass device='cuda:N' (or use gloo on CPU)"
    if model.training:
        return "the model is in training mode: call model.eval() (tensor-parallel layers are for inference)"
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None and init is None:
        return (f"{meta} is on the meta device and no init was given: load real weights, or pass "
                "init=fuseinfer.parallel.random_init(seed) for random weights")
    return None


def _shard_spec(info: TPInfo):
    def spec(name: str):
        if _COLUMN.search(name):
            return (0, info.rank, info.size)  # weight (N, K) rows / bias (N,): this rank's output features
        if _ROW.search(name):  # weight (N, K) columns: this rank's input features; the bias on rank 0 only
            return (1, info.rank, info.size) if name.endswith(".weight") else (None if info.rank == 0 else "drop")
        return None  # replicated

    return spec


def tensor_parallel(model: nn.Module, tp_size: int | None = None, group=None, *, device=None,
                    init: Init | None = None, config=None):
    """Shard ``model`` (an unpatched OPTForCausalLM in eval mode, on the CPU, on this rank's GPU or on the meta
    device with ``init``) over the ranks of ``group`` (default: the whole default group; ``init_distributed``
    joins it), place this rank's shard on ``device`` (default: the current GPU under NCCL, the CPU under gloo),
    and patch it (``config``: a PatchConfig, default every op). Returns the PatchReport.

    Every rank must call it (it runs collectives). Bad input (TP size not dividing the heads or ffn, more ranks
    than GPUs, a model accelerate dispatched, no NCCL for CUDA, ranks with different configs) raises one
    FuseInferError on every rank, naming the rank that found it, before anything is changed."""
    from fuseinfer.core.config import PatchConfig
    from fuseinfer.patching import patch
    from fuseinfer.core.state import patch_state, unwrapped

    model = unwrapped(model)
    if not isinstance(model, nn.Module):
        raise FuseInferError(f"tensor_parallel takes a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise FuseInferError("tensor_parallel needs torch.distributed initialised: call "
                             "fuseinfer.parallel.init_distributed() in a script launched by torchrun")
    config = PatchConfig() if config is None else config
    backend = dist.get_backend(group)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    error = _local_error(model, size, tp_size, device, backend, init)
    hashes = gather_errors(error, None if error else _config_hash(model, size), group)
    if len(set(hashes)) > 1:
        raise FuseInferError(f"the ranks disagree on the model (config/dtype hash per rank: {hashes}): load the same "
                             "model in the same dtype on every rank")
    info = TPInfo(rank, size, group)
    report, error = None, None
    try:
        materialize(model, device, init, _shard_spec(info))
        for m in model.modules():
            if isinstance(m, OPTAttention):
                m.num_heads //= size  # this rank's heads (head_dim unchanged)
                m.embed_dim //= size  # this rank's q/k/v width (the fused q/k/v buffer is (3 E/tp, E))
            if isinstance(m, (OPTAttention, OPTDecoderLayer)):
                m._fuseinfer_tp = info
        report = patch(model, config)
        for m in model.modules():
            if type(m) in _FUSED_TP:
                m.__class__ = _FUSED_TP[type(m)]
        state = patch_state(model).state
        state["classes"] = [(m, _UNFUSED_TP.get(cls, cls)) for m, cls in state["classes"]]
        for swap in report.swaps:
            if swap.new_class in ("FusedOPTAttention", "FusedOPTDecoderLayer"):
                swap.new_class = "TP" + swap.new_class
        report.placement = {"tensor_parallel": f"rank {rank} of {size} on {device} ({backend}): "
                                               f"{model.config.num_attention_heads // size} heads and "
                                               f"{model.config.ffn_dim // size} ffn units per rank, "
                                               "LM head replicated"}
        object.__setattr__(model, TP_ATTR, info)
    except Exception as exc:  # (OOM on one rank, say): every rank raises, none waits on a collective
        error = f"{type(exc).__name__}: {exc}"
    gather_errors(error, None, group)
    return report

