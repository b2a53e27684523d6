"""Perplexity protocols over one long token stream.

* GPTQ / SmoothQuant (default): non-overlapping windows of ``seq_len`` tokens, the tail shorter than a window
  dropped; NLL of a window = mean next-token cross entropy inside it (``model(input_ids=w, labels=w).loss``);
  PPL = exp(mean window NLL).
* Sliding window (``--stride``), as in https://huggingface.co/docs/transformers/perplexity: windows of
  ``max_length`` tokens moved by ``stride``; labels of tokens already scored by an earlier window are -100; each
  window's NLL is weighted by the number of tokens it scores; PPL = exp(weighted mean NLL). The weight is the
  exact count of scored labels (those after the window's first token, which the loss's shift never scores), so
  the result is the mean NLL per token; the guide subtracts one per window instead, which is the same count for
  the first window and one fewer (of ``stride``) for the others.

Both reduce to PPL = exp(sum_i w_i * nll_i / sum_i w_i) over :class:`Window`\\ s with weights ``w_i``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Window:
    """One forward pass: ``input_ids`` and ``labels`` (1, L) int64; ``weight`` of its mean NLL in the average."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    weight: int


def gptq_windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> list[Window]:
    """Non-overlapping ``seq_len`` windows of ids (1, N), tail dropped, each weighted 1."""
    count = ids.shape[1] // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    windows = []
    for i in range(count):
        w = ids[:, i * seq_len:(i + 1) * seq_len]  # (1, seq_len)
        windows.append(Window(w, w, 1))
    return windows


def sliding_windows(ids: torch.Tensor, max_length: int, stride: int, max_windows: int | None = None) -> list[Window]:
    """Windows of ``max_length`` moved by ``stride`` over ids (1, N); tokens scored once, weight = tokens scored.
    A window that would score nothing (a last window of one token: its loss is NaN) is left out."""
    total = ids.shape[1]
    windows, prev_end = [], 0
    for begin in range(0, total, stride):
        if max_windows is not None and len(windows) == max_windows:
            break
        end = min(begin + max_length, total)
        target_len = end - prev_end  # tokens not scored by an earlier window
        w = ids[:, begin:end]  # (1, L)
        labels = w.clone()
        labels[:, :-target_len] = -100
        scored = int((labels[:, 1:] != -100).sum())  # the loss predicts labels[:, 1:] from positions [:-1]
        if scored:
            windows.append(Window(w, labels, scored))
        prev_end = end
        if end == total:
            break
    return windows


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # weighted mean NLL (nats per token)
    windows: int


def perplexity(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], windows: list[Window],
               device: torch.device, on_window: Callable[[], None] | None = None) -> Perplexity:
    """PPL over ``windows``; ``loss_fn(input_ids, labels)`` returns the mean NLL of one window (a scalar)."""
    total, weights = 0.0, 0
    for window in windows:
        nll = float(loss_fn(window.input_ids.to(device), window.labels.to(device)))
        total += window.weight * nll
        weights += window.weight
        if on_window is not None:
            on_window()
    nll = total / weights
    return Perplexity(math.exp(nll), nll, len(windows))
