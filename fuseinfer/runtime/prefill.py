"""Fast prefill for patched models: a lean layer loop, and CUDA graphs of it per prompt-length bucket.

A patched model's forward goes through transformers' module calls, mask building and output plumbing: ~170 op
calls for OPT-1.3b whose host cost (5-6 ms) exceeded the GPU's (about 1 ms at 128 tokens). Two paths replace it
where the model allows (every op patched, no filter_fn, eval mode, no hooks, no autocast to another dtype; else the
patched modules run as before):

* **lean** (:func:`lean_logits`): the model family's lean loop (``ModelFamily.lean_logits``; OPT's:
  ``models/opt/lean.py``, the Llama family's: ``models/llama/lean.py``): the same fused ops in the same order as the patched modules, called in one loop over
  (B*S, E) activations: on CUDA straight into the extension (the ``fuseinfer_C`` ops), elsewhere through the op wrappers
  (their references). No mask is built (the attention op takes the key mask and ``q_start`` as they are), the LM
  head runs for the last position only. Nothing in it reads the GPU from the host, so a caller can capture it in a
  CUDA graph. 8-bit models (SmoothQuant W8A8, FP8, int8 weight-only W8A16) take it too, with the ops of their
  patched modules (at decode-sized prompts on CUDA, at most ``DECODE_ROWS`` rows, their linears run the 8-bit weight
  GEMV, as the patched modules do).
* **graph** (:class:`PrefillGraph`): fast decode's prefill (``_Session.begin``) replays, per batch bucket and
  prompt-length bucket (a multiple of ``LENGTH_BUCKET`` tokens), a CUDA graph of the lean loop over the session's
  static cache. A prompt of ``p`` tokens is right-padded to its bucket: the padding's keys land in cache slots
  ``[p, bucket)``, which the causal bound hides until decode overwrites them, and the logits are taken at
  position ``p - 1``. Graphs are captured on a bucket's first use, belong to the session's KV cache (so every
  session of a batch bucket, one per setting, replays the same ones: decode.py), share one memory pool per cache
  and go with it (``fuseinfer.runtime.release``).

The model's ``RuntimeConfig.prefill`` (``PatchConfig(runtime=...)``; default from ``FUSEINFER_PREFILL``) picks:
``auto`` (graphs up to ``AUTO_GRAPH_MAX_TOKENS`` bucket tokens on CUDA, the lean loop elsewhere), ``graph`` (graphs
wherever they apply), ``lean`` or ``module`` (the patched modules, as before); ``RuntimeConfig.cuda_graphs=False``
turns the graphs off.
``fuseinfer.prefill(model, input_ids, attention_mask)`` is the lean loop without a cache, for callers who need
the next-token logits of a prompt.
"""
from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.state import model_lock, patch_state, runtime_config, unwrapped
from fuseinfer.layers.linear import DECODE_ROWS
from fuseinfer.runtime.cache import COUNTS
from fuseinfer.runtime.graphs import warm_and_capture

LENGTH_BUCKET = 128  # prompt lengths round up to a multiple of this in the graph path (<= 127 padded tokens)
# graphs where bucket rows x bucket length <= this (auto); above it the GPU time dwarfs the lean loop's host time
AUTO_GRAPH_MAX_TOKENS = 4096
# KV cache -> {length bucket: PrefillGraph} (a graph holds only a weak reference to its cache)
_graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _family(model: nn.Module):
    """The model's family (``model`` may be a weak proxy), or None."""
    from fuseinfer.models import family

    return family(getattr(getattr(model, "config", None), "model_type", None))


def lean_reason(model: nn.Module, weights: bool = True) -> str | None:
    """None when the lean loop computes what the patched modules would for this call, else why not (the family's
    ``prefill_reason``: checked at every call; ``weights``: also that the weights are still those patch fused)."""
    fam = _family(model)
    if fam is None:
        return "the lean prefill needs a patched model of a family fuseinfer patches: call fuseinfer.patch(model)"
    return fam.prefill_reason(model, weights)


def lean_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache=None, q_start=None,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The lean loop over a patched model (check :func:`lean_reason` first): fp32 logits (B, V) of the last
    position. tokens, positions: (B, S) int64 (the model's positions, -1 on padding). With ``cache`` (a
    :class:`~fuseinfer.runtime.StaticKVCache`) k/v go to ``cache.write_idx`` and the mask is the cache's
    ``key_mask`` with ``q_start`` (B,) int32, as the decode forward does; without, ``key_mask`` (B, S) bool or
    None."""
    fam = _family(model)
    if cache is not None:
        return fam.lean_logits(model, tokens, positions, cache.key_mask, q_start, cache, cache.write_idx)
    return fam.lean_logits(model, tokens, positions, key_mask)


def prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits of a prompt through a patched model: fp32 (B, V), those of the last position (what
    ``model(input_ids, attention_mask=..., logits_to_keep=1).logits[:, -1]`` gives, without transformers' host
    work). Left-pad batches (the last column must be a real token). Inference only (no gradients). Takes the lean
    loop where the model allows it (see :func:`lean_reason`), else the patched forward. No host sync: a caller may
    capture it in a CUDA graph (static shapes, after a warm-up call)."""
    model = unwrapped(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or min(input_ids.shape) == 0:
        raise FuseInferError(f"input_ids must be a non-empty (batch, length) tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise FuseInferError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
    # the model's lock: a patch / unpatch in another thread waits for this call (the lean loop reads the patched
    # layers directly, never through the decoder's locked forward), and this call waits for it
    with model_lock(model), torch.no_grad():
        if attention_mask is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
            key_mask = None
        else:
            mask = attention_mask.long()
            positions = mask.cumsum(1) * mask - 1  # (B, S), -1 on padding, as OPT does
            key_mask = attention_mask.bool()
        if lean_reason(model) is not None:
            # the positions passed: what OPT computes from the mask, and what rotary models need for left padding
            # (they would count the padding otherwise), as generate and the lean loop use them
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                        logits_to_keep=1)
            return out.logits[:, -1].float()
        return lean_logits(model, input_ids, positions, key_mask=key_mask)


def mode(model: nn.Module) -> str:
    """The prefill ``model`` runs with (its ``RuntimeConfig.prefill``): ``auto``, ``graph``, ``lean`` or
    ``module``."""
    return runtime_config(model).prefill


def length_bucket(p: int) -> int:
    """The graph path's prompt-length bucket: ``p`` rounded up to a multiple of LENGTH_BUCKET."""
    return -(-p // LENGTH_BUCKET) * LENGTH_BUCKET


def session_prefill(session, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Fast decode's prefill (``_Session.begin``): ids, pos (bucket rows, P) into the session's cache, slots
    [0, P) (``session.cache.write_idx``), with its key mask and ``q_start``; fp32 logits of position P - 1
    (bucket rows, V). Graph, lean loop or patched modules, as the model's RuntimeConfig and the model allow."""
    model = session.model
    choice = mode(model)
    # (a captured graph's weights are checked when it is captured; a session's model keeps them: session_for)
    if choice != "module" and lean_reason(model, weights=False) is None:
        graph = _graph_for(session, ids.shape[1], choice)
        if graph is not None:
            return graph.run(ids, pos, session.pad)
        if lean_reason(model) is None:
            return lean_logits(model, ids, pos, session.cache, session.q_start)
    return session.forward(model, ids, pos, session.cache, session.q_start)


def _graph_for(session, p: int, choice: str):
    """The session's prefill graph for prompts of ``p`` tokens (captured on first use), or None where the graph
    path does not apply: not CUDA, CUDA graphs off, the bucket past the cache, or (auto) too many tokens."""
    dev = session.tokens.device
    if choice not in ("auto", "graph") or dev.type != "cuda" or not runtime_config(session.model).cuda_graphs:
        return None
    length = length_bucket(p)
    if length > session.capacity or (choice == "auto" and session.bucket * length > AUTO_GRAPH_MAX_TOKENS):
        return None
    if session.bucket * p <= DECODE_ROWS and patch_state(session.model).config.quant is not None:
        # int8 linears at <= DECODE_ROWS rows run the GEMV (the modules and the lean loop); a graph pads the prompt
        # to its 128-token bucket, which would switch them to the prefill GEMM (another computation for W8A8)
        return None
    graphs = _graphs.setdefault(session.cache, {})
    graph = graphs.get(length)
    if graph is None:
        if lean_reason(session.model) is not None:  # the weights, unchecked by the caller
            return None
        pool = next(iter(graphs.values())).pool if graphs else None
        graph = graphs[length] = PrefillGraph(session, length, pool)
    return graph


def graph_stats(session) -> dict:
    """{length bucket: {'capture_ms', 'pool_bytes'}} of the prefill graphs of a session's cache (the benchmark)."""
    return {n: {"capture_ms": g.capture_ms, "pool_bytes": g.pool_bytes}
            for n, g in _graphs.get(session.cache, {}).items()}


class PrefillGraph:
    """A CUDA graph of the lean loop over a session's cache for prompts right-padded to ``length`` tokens. It reads
    nothing of the session but its model and cache, so every session over that cache replays it."""

    def __init__(self, session, length: int, pool=None):
        """pool: another prefill graph's memory pool to share (graphs of one cache never run concurrently: calls
        are serialised per model, and each graph's logits are consumed before the next replay)."""
        COUNTS["prefill_graph"] += 1
        self.model = session.model  # (a weak proxy)
        self.cache = weakref.proxy(session.cache)  # (the cache keys _graphs: a strong reference would keep it)
        bucket, dev = session.bucket, session.tokens.device
        self.q_start = torch.zeros(bucket, dtype=torch.int32, device=dev)  # (Bb,) prefill starts at slot 0
        self.length = length
        self.ids = torch.full((bucket, length), session.pad, dtype=torch.long, device=dev)  # (Bb, L)
        self.pos = torch.full((bucket, length), -1, dtype=torch.long, device=dev)  # (Bb, L)
        self.slots = torch.arange(length, device=dev)  # (L,) cache slots the graph writes
        self.last = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) position whose logits are returned
        self.graph = torch.cuda.CUDAGraph()
        self.logits = None
        torch.cuda.synchronize(dev)
        before, start = torch.cuda.memory_reserved(dev), time.perf_counter()
        self._capture(pool)
        torch.cuda.synchronize(dev)
        self.capture_ms = (time.perf_counter() - start) * 1e3  # two warm-up runs + the capture
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before  # what the capture reserved (0 when shared)
        self.pool = self.graph.pool()

    def _forward(self) -> torch.Tensor:
        cache = self.cache
        return _family(self.model).lean_logits(self.model, self.ids, self.pos, cache.key_mask, self.q_start, cache,
                                               self.slots, self.last)

    def _capture(self, pool) -> None:
        self.logits = warm_and_capture(self.graph, self._forward, self.ids.device, pool)  # (Bb, V) fp32

    def run(self, ids: torch.Tensor, pos: torch.Tensor, pad: int) -> torch.Tensor:
        """ids, pos (Bb, P <= length) -> fp32 logits (Bb, V) of position P - 1; valid until the next replay of a
        graph of this cache's pool. pad: the token the right padding holds (any embeddable id: it is hidden)."""
        p = ids.shape[1]
        self.ids[:, :p].copy_(ids)
        self.pos[:, :p].copy_(pos)
        if p < self.length:  # right padding: its k/v go to slots the causal bound hides until decode writes them
            self.ids[:, p:].fill_(pad)
            self.pos[:, p:].fill_(-1)
        self.last.fill_(p - 1)
        self.graph.replay()
        return self.logits
