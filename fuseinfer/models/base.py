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
