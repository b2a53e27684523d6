"""Backends: the ways of running the same model that the eval CLI compares and the profiler profiles.

Each backend loads its own fresh model and exposes the same small interface: ``start`` (allocate what a batch of
sequences needs, untimed), ``prefill`` (prompt -> first greedy token), ``decode_step`` (token -> next greedy
token, using the cache ``prefill`` filled) and ``loss`` (one perplexity window). ``unavailable_reason`` says why a
backend cannot run here (a missing package, say); the eval then reports the reason in its row and goes on.

Here: the interface, the options some backends take (:class:`BackendOptions`) and the plain backends (``eager``,
``compile``, ``fuseinfer``). A feature package defines its backends in its own ``backends.py`` on this interface;
the eval CLI lists the backends it runs in ``fuseinfer/eval/backends/``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from fuseinfer.core.state import patch_report, patch_state
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.models import ModelSource, load_model, model_stats
from fuseinfer.models import family
from fuseinfer.patching import patch, unpatch
from fuseinfer.runtime import release


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, S, V) -> next token ids (B, 1) from the last position."""
    return logits[:, -1].argmax(-1, keepdim=True)


@dataclass(frozen=True)
class BackendOptions:
    """What some backends take beyond the model, from the caller (e.g. the eval CLI's flags); None: the knob of the
    same meaning (``fuseinfer.core.knobs``), else its default."""

    onnx_dir: str | None = None  # ort / ort-plain / tensorrt: keep and reuse exports here (FUSEINFER_ONNX_DIR)
    calibration_data: str | None = None  # fuseinfer-w8a8 (FUSEINFER_CALIBRATION_DATA)
    calibration_samples: int | None = None  # fuseinfer-w8a8 (FUSEINFER_CALIBRATION_SAMPLES)
    data_dir: str | None = None  # folder with wiki.valid.raw: fuseinfer-w8a8's default calibration text


class Backend:
    """Interface and shared loading; subclasses override ``prepare`` and the forward methods they change."""

    name = ""
    summary = ""

    def __init__(self, source: ModelSource, config, dtype: torch.dtype, device: torch.device, seed: int,
                 options: BackendOptions | None = None):
        self.source, self.config, self.dtype, self.device, self.seed = source, config, dtype, device, seed
        self.options = options if options is not None else BackendOptions()
        self.model: nn.Module | None = None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` here, or None when it can."""
        return None

    def load(self) -> None:
        """Load a fresh model, count its sizes (before any change) and prepare it."""
        self.model = load_model(self.source, self.config, self.dtype, self.device, self.seed)
        self.stats = model_stats(self.model)
        self.prepare()

    def prepare(self) -> None:
        """Turn the loaded model into this backend's model (patch, compile, export ...)."""

    def start(self, batch_size: int, max_len: int) -> None:
        """Get ready for batches of ``batch_size`` sequences of up to ``max_len`` tokens (untimed)."""

    def end(self) -> None:
        """Release what ``start`` and the last sequence allocated (the KV cache)."""
        self.cache = None

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt (B, P) into a fresh KV cache; returns the first greedy tokens (B, 1)."""
        raise NotImplementedError

    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens (B, 1) after those already cached; returns the next greedy tokens (B, 1)."""
        raise NotImplementedError

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of a window, input_ids / labels (1, L) -> scalar."""
        return self.model(input_ids=input_ids, labels=labels).loss

    def details(self) -> dict:
        """Backend-specific facts for the results (e.g. which kernels run)."""
        return {}

    def close(self) -> None:
        """Release the model and everything cached for it."""
        self.end()
        self.model = None


class EagerBackend(Backend):
    """The unmodified Hugging Face model with its default (sdpa) attention and a dynamic KV cache."""

    name = "eager"
    summary = "Hugging Face model as loaded (sdpa attention, DynamicCache)"

    def prefill(self, input_ids):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return greedy(out.logits)  # (B, 1)

    def decode_step(self, tokens):
        out = self.model(input_ids=tokens, past_key_values=self.cache, use_cache=True)
        return greedy(out.logits)  # (B, 1)


class CompileBackend(Backend):
    """torch.compile as a user would set it up for generation: a compiled forward for prefill and perplexity, and
    a static KV cache (``transformers.StaticCache``) with a decode step compiled with ``mode="reduce-overhead"``
    (CUDA graphs on GPU). Compilation happens in the first calls, which the runner times apart."""

    name = "compile"
    summary = "torch.compile: compiled forward; StaticCache + reduce-overhead decode step"

    @classmethod
    def unavailable_reason(cls, device):
        if device.type == "cuda" and importlib.util.find_spec("triton") is None:
            return "triton is not installed (torch.compile needs it for CUDA)"
        return None

    def prepare(self):
        self._forward = torch.compile(self.model, dynamic=False)
        self._step = torch.compile(self._decode, mode="reduce-overhead", dynamic=False)

    def start(self, batch_size, max_len):
        from transformers import StaticCache

        cfg = self.model.config
        self.cache = StaticCache(config=cfg, max_cache_len=max_len)
        # allocated up front: a cache first touched inside a compiled region would not keep static addresses
        kv_heads, head_dim = family(cfg.model_type).kv_layout(cfg)
        self.cache.early_initialization(batch_size=batch_size, num_heads=kv_heads, head_dim=head_dim,
                                        dtype=self.dtype, device=self.device)
        # every cache slot marked valid: causality hides the slots not written yet; static shape for the graphs
        self.mask = torch.ones(batch_size, max_len, dtype=torch.long, device=self.device)  # (B, max_len)
        torch._dynamo.mark_static_address(self.mask)  # a graph input that CUDA graphs need not copy per replay
        positions = torch.arange(max_len, device=self.device)
        self.positions = positions.view(max_len, 1, 1).expand(max_len, batch_size, 1).contiguous()  # (max_len, B, 1)
        self.next_position = 0

    def prefill(self, input_ids):
        length = input_ids.shape[1]
        self.cache.reset()
        position_ids = self.positions[:length, :, 0].T  # (B, P)
        out = self._forward(input_ids=input_ids, attention_mask=self.mask, position_ids=position_ids,
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next_position = length
        return greedy(out.logits)  # (B, 1)

    def decode_step(self, tokens):
        torch.compiler.cudagraph_mark_step_begin()
        next_tokens = self._step(tokens, self.positions[self.next_position])  # (B, 1)
        self.next_position += 1
        return next_tokens.clone()  # the next graph replay overwrites its output buffer

    def _decode(self, tokens, position_ids):
        """tokens, position_ids (B, 1) -> next greedy tokens (B, 1); compiled into one graph."""
        out = self.model(input_ids=tokens, attention_mask=self.mask, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True)
        return greedy(out.logits)

    def loss(self, input_ids, labels):
        return self._forward(input_ids=input_ids, labels=labels).loss

    def close(self):
        super().close()
        self._forward = self._step = None
        torch._dynamo.reset()  # drop compiled graphs and CUDA-graph memory pools before the next backend


class FuseInferBackend(EagerBackend):
    """The model patched by ``fuseinfer.patch`` (fused LayerNorm, GEMM epilogues, q/k/v GEMM, attention), decoding
    through fuseinfer's runtime: a static KV cache and one CUDA-graph replay per token (eager on CPU)."""

    name = "fuseinfer"
    summary = "fuseinfer.patch(model): fused CUDA ops; static cache + CUDA-graph decode"
    loaded_patched = False  # True for a fuseinfer quantized checkpoint, which loads patched

    def prepare(self):
        # a fuseinfer quantized checkpoint loads patched (transformers' quantizer registry): run it as it is
        self.loaded_patched = patch_state(self.model) is not None
        self.report = patch_report(self.model) if self.loaded_patched else patch(self.model)
        self.decode = "not run"  # set by start(): the path the timed decode steps take

    def start(self, batch_size, max_len):
        from fuseinfer.runtime.decode import Sampling, decode_forward, session_for

        forward, why = decode_forward(self.model)
        if forward is None:
            raise EvalError(why)
        no_eos = torch.empty(0, dtype=torch.long)  # latency runs never stop early
        self.session = session_for(self.model, forward, batch_size, max_len, Sampling(), max_len, no_eos,
                                   pad=self.model.config.pad_token_id or 0)
        self.decode = ("static cache" + (" + CUDA graph replay" if self.session.graphs else "") + ", step: "
                       + self.session.path)

    def end(self):
        if self.model is not None:
            release(self.model)  # the static cache and decode graph
        self.session = None

    def prefill(self, input_ids):
        return self.session.begin(input_ids, torch.ones_like(input_ids)).clone()  # (B, 1)

    def decode_step(self, tokens):
        """Feeds the tokens the previous step chose itself (they stay on the GPU); ``tokens`` are those."""
        return self.session.advance().clone()  # (B, 1); the next replay overwrites the graph's buffer

    def details(self):
        return {"patch_backends": {op: sorted(b) for op, b in sorted(self.report.backends.items())},
                "patch_extension": self.report.extension,
                "patched_modules": len(self.report.swaps),
                "decode": self.decode}

    def close(self):
        if self.model is not None and patch_state(self.model) is not None:
            if self.loaded_patched:  # (nothing to unpatch to: the checkpoint holds no original weights)
                release(self.model)
            else:
                unpatch(self.model)  # frees the runtime's cache and graph
        super().close()

