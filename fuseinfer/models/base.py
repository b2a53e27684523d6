"""The interface a model family implements so that the engine, the runtime and the feature packages can use it.

A family is the patch rules of one ``config.model_type`` (OPT today): which modules it swaps and how to undo it,
and the two pieces fast decode needs: a decode forward over fuseinfer's static KV cache, and optionally a
one-kernel decode step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

from fuseinfer.core.config import PatchConfig, PatchReport

# (model, tokens (B, S), positions (B, S), cache, q_start (B,)) -> fp32 logits of the last position (B, V)
DecodeForward = Callable[..., torch.Tensor]
# (tokens (B, 1), positions (B, 1), q_start (B,)) -> fp32 logits (B, V)
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ModelFamily(ABC):
    """Patch rules and fast-decode hooks of one model family."""

    model_type: str = ""
    architectures: tuple[str, ...] = ()  # the transformers classes the family patches

    @abstractmethod
    def patch(self, model: nn.Module, config: PatchConfig, report: PatchReport) -> dict:
        """Swap ``model``'s modules in place (already checked by the engine), record them in ``report``; returns
        what ``unpatch`` needs."""

    @abstractmethod
    def unpatch(self, model: nn.Module, state: dict) -> None:
        """Undo ``patch`` exactly, given what it returned."""

    @abstractmethod
    def decode_forward(self, model: nn.Module) -> tuple[DecodeForward | None, str | None]:
        """(the per-op decode forward of a patched model, None), or (None, why the model cannot take it)."""

    def decode_step_kernel(self, model: nn.Module, cache) -> tuple[DecodeStep | None, str | None]:
        """(a one-kernel decode step over ``cache``, None), or (None, why not); by default there is none."""
        return None, f"no one-kernel decode step for {self.model_type or type(self).__name__}"

    # ---- the runtime's lean prefill and tensor parallel (None / a refusal where a family has neither) ----

    def prefill_reason(self, model: nn.Module, weights: bool = True) -> str | None:
        """None when :meth:`lean_logits` computes what ``model``'s patched modules would for this call, else why
        not (checked at every call; ``weights``: also that the weights are still those patch fused)."""
        return f"no lean prefill for {self.model_type or type(self).__name__}"

    def lean_logits(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, key_mask=None,
                    q_start=None, cache=None, slots=None, last=None) -> torch.Tensor:
        """The lean layer loop (check :meth:`prefill_reason` first): fp32 logits (B, V) at position ``last`` ((1,)
        int64; None: the last). tokens, positions: (B, S) int64. With ``cache`` (a StaticKVCache) k/v go to its
        ``slots`` and attention reads the whole cache with ``key_mask`` (the cache's) and ``q_start`` (B,) int32;
        without, attention reads this prompt's k/v, ``key_mask`` (B, S) bool or None."""
        raise NotImplementedError(self.prefill_reason(model))

    def tp_reason(self, model: nn.Module, size: int) -> str | None:
        """Why ``model`` cannot be split over ``size`` tensor-parallel ranks, or None."""
        return f"no tensor-parallel plan for {self.model_type or type(self).__name__}"

    def tp_shard_spec(self, info) -> Callable[[str], object]:
        """``materialize``'s spec for rank ``info.rank`` of ``info.size``: parameter name -> (dim, rank, size),
        None (replicated) or "drop"."""
        raise NotImplementedError

    def tp_prepare(self, model: nn.Module, info) -> None:
        """After the shards are placed, before ``patch``: what the modules must know of the split."""
        raise NotImplementedError

    def tp_finish(self, model: nn.Module, info, state: dict, report: PatchReport) -> str:
        """After ``patch`` (``state``: what it returned): the tensor-parallel modules in place; returns how the
        model is split, for the report."""
        raise NotImplementedError
