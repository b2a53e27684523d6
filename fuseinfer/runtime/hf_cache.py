"""The middle path of a patched ``model.generate``: transformers' own generation loop (beam search, assisted
decoding, custom logits processors or stopping criteria, ...), with the model's forward over fuseinfer's static
KV cache, where a decode step (one new token per row) is one CUDA-graph replay of all layers and the LM head.

:class:`FusedCache` is a ``transformers.Cache`` passed to generate as ``past_key_values``. While the call runs,
the model's ``forward`` is wrapped (:func:`forward_over_fused_cache`): a call that brings a FusedCache runs
fuseinfer's decode forward over the cache's static buffers instead of the model's own forward; any other call
(e.g. an assistant model's) runs unchanged. The cache knows how many tokens it holds on the host (so it never
reads ``cache_position``, which transformers 5.17 and 5.23 pass differently), reorders its rows in place for beam
search (``reorder_cache``) and shortens for assisted decoding (``crop``).

Buffers and graphs (:class:`ForwardGraph`, one per batch size) live with the model's fast-decode sessions, so
``release(model)``, ``unpatch`` and a move of the model's tensors drop them too.
"""
from __future__ import annotations

import functools
import weakref

import torch
from transformers import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.state import patch_state, runtime_config
from fuseinfer.core import decode_plan
from fuseinfer.runtime.cache import kv_cache, refuse_fp8
from fuseinfer.runtime.decode import CAPACITY_ROUND, sessions_of
from fuseinfer.runtime.graphs import capture_stream

KEY = "hf"  # sessions[(KEY, rows)] -> ForwardGraph


class ForwardGraph:
    """A static KV cache of ``rows`` rows and the forward of one decode step over it, captured as a CUDA graph on
    the first decode step (on CUDA, unless the model's ``RuntimeConfig.cuda_graphs`` is False)."""

    def __deepcopy__(self, memo):  # like _Session: copies and pickles of the model start without it
        return None

    def __reduce__(self):
        return type(None), ()

    def __init__(self, model, forward, rows: int, capacity: int, weights: tuple):
        refuse_fp8(model, "this generate setting (transformers' loop over fuseinfer's cache)")
        cfg, p = model.config, next(model.parameters())
        family = patch_state(model).family
        kv_heads, head_dim = family.kv_layout(cfg)
        self.model, self.forward, self.rows, self.capacity = weakref.proxy(model), forward, rows, capacity
        self.weights = weights  # see decode.session_for: where the tensors the graph reads were
        dev = self.device = p.device
        # tensor-parallel (this rank's heads, no one-kernel step) and device_map models (a cache per layer device,
        # no graph) as fast decode runs them (fuseinfer/core/decode_plan.py)
        plan = decode_plan.plan(model, family.decoder_layers(model))
        self.cache = kv_cache(model, plan, cfg.num_hidden_layers, rows, kv_heads, head_dim, capacity, p.dtype, dev)
        self.capture_mode = plan.capture_mode
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # (B, 1)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # (B, 1) OPT positions
        self.q_start = torch.zeros(rows, dtype=torch.int32, device=dev)  # (B,) slot of the new token
        self.decode_idx = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) the same slot
        self.step_kernel = None if plan.no_kernel else patch_state(model).family.decode_step_kernel(model,
                                                                                                  self.cache)[0]
        self.use_graph = dev.type == "cuda" and runtime_config(model).cuda_graphs and not plan.no_graphs
        self.graph, self.logits = None, None  # logits: (B, V) fp32, the graph's output

    def _step(self) -> torch.Tensor:
        if self.step_kernel is not None:
            return self.step_kernel(self.tokens, self.positions, self.q_start)
        self.cache.write_idx = self.decode_idx
        return self.forward(self.model, self.tokens, self.positions, self.cache, self.q_start)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (it writes this step's k/v, which the replay rewrites the same)
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=capture_stream(self.graph, self.device),
                              capture_error_mode=self.capture_mode):
            self.logits = self._step()

    def run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, start: int,
            keep: int) -> torch.Tensor:
        """ids, positions (B, S) at slots [start, start + S); mask (B, start + S) -> fp32 logits (B, keep, V) of
        the last ``keep`` positions (keep 0: all S)."""
        s = ids.shape[1]
        end = start + s
        if end > self.capacity:
            raise FuseInferError(f"fuseinfer's static cache holds {self.capacity} tokens, the call needs {end}")
        self.cache.key_mask[:, :end].copy_(mask.bool())
        if s == 1 and keep in (0, 1):  # a decode step: one replay
            self.tokens.copy_(ids)
            self.positions.copy_(positions)
            self.q_start.fill_(start)
            self.decode_idx.fill_(start)
            if not self.use_graph:
                return self._step()[:, None]
            if self.graph is None:
                self._capture()
            self.graph.replay()
            return self.logits.clone()[:, None]  # (the buffer is the next replay's)
        self.cache.write_idx = torch.arange(start, end, device=self.device)
        q_start = torch.full((self.rows,), start, dtype=torch.int32, device=self.device)
        logits = self.forward(self.model, ids, positions, self.cache, q_start, keep=keep or s)
        return logits  # (B, keep, V)

    def reorder(self, beam_idx: torch.Tensor, length: int) -> None:
        """Beam search: row i takes row beam_idx[i]'s keys and values (slots [0, length)), in place."""
        idx = beam_idx.to(self.device)
        for buf in self.cache.keys + self.cache.values:
            buf[:, :, :length].copy_(buf[:, :, :length].index_select(0, idx))


class FusedCache(Cache):
    """``past_key_values`` for transformers' generate over fuseinfer's static cache (see the module docstring).
    Its buffers are made at the first forward, for the batch that forward brings (prompt rows x beams)."""

    def __init__(self, model, forward, max_length: int):
        # (no Cache.__init__: its layers are transformers' own; this cache answers the calls generate makes)
        self.layers = []
        self._model = weakref.ref(model)
        self._forward = forward
        self.max_length = max_length
        self.length = 0  # tokens held (host int: no sync)
        self.graph: ForwardGraph | None = None

    def __len__(self):
        model = self._model()
        return model.config.num_hidden_layers if model is not None else 0

    @property
    def is_compileable(self) -> bool:  # generate then keeps 2D masks and does not torch.compile the forward
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.graph is not None

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    def get_seq_length(self, layer_idx: int = 0, *args) -> int:
        return self.length

    def get_max_length(self, *args) -> int:
        return self.graph.capacity if self.graph is not None else self.max_length

    get_max_cache_shape = get_max_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.graph is not None:
            self.graph.reorder(beam_idx, self.length)

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many tokens (transformers 5.2x); positive: keep that many (the older meaning)."""
        if tokens_to_remove < 0:
            self.length = max(0, self.length + tokens_to_remove)
        elif tokens_to_remove > 0:
            self.length = min(self.length, tokens_to_remove)

    def to_dynamic(self):
        """The tokens held as transformers' ``DynamicCache`` (copies of slots [0, length) of every layer): what
        generate returns as ``past_key_values``, so that the caller gets transformers' cache type (which it can pass
        to a later call, unlike this one, whose buffers the model's next call reuses)."""
        from transformers import DynamicCache

        out = DynamicCache()
        if self.graph is not None:
            cache = self.graph.cache
            for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
                out.update(k[:, :, :self.length].clone(), v[:, :, :self.length].clone(), i)
        return out

    def batch_repeat_interleave(self, repeats: int):
        raise FuseInferError("fuseinfer's static cache cannot repeat its rows (batch_repeat_interleave)")

    def batch_select_indices(self, indices: torch.Tensor):
        raise FuseInferError("fuseinfer's static cache cannot select rows (batch_select_indices)")

    def update(self, *args, **kwargs):
        raise FuseInferError("fuseinfer's FusedCache serves the patched model's generate forward only")

    def forward(self, model, input_ids: torch.Tensor, attention_mask, position_ids, logits_to_keep) -> torch.Tensor:
        """The model's logits (B, keep, V) fp32 for input_ids (B, S) appended to the cache."""
        b, s = input_ids.shape
        if self.graph is None:
            self.graph = graph_for(model, self._forward, b, self.max_length)
        if b != self.graph.rows:
            raise FuseInferError(f"FusedCache holds {self.graph.rows} rows, the forward brings {b}")
        end = self.length + s
        if attention_mask is None:
            attention_mask = torch.ones(b, end, dtype=torch.long, device=input_ids.device)
        attention_mask = attention_mask[:, -end:] if attention_mask.shape[1] >= end else torch.cat(
            [torch.ones(b, end - attention_mask.shape[1], dtype=attention_mask.dtype,
                        device=attention_mask.device), attention_mask], 1)
        if position_ids is None:  # OPT's rule: cumulative count of real tokens, -1 on padding
            mask = attention_mask.long()
            position_ids = (mask.cumsum(1) * mask - 1)[:, -s:]
        keep = int(logits_to_keep) if isinstance(logits_to_keep, int) else 0
        logits = self.graph.run(input_ids, position_ids[:, -s:], attention_mask, self.length, keep)
        self.length = end
        return logits


def graph_for(model, forward, rows: int, max_length: int) -> ForwardGraph:
    """The model's ForwardGraph for ``rows`` rows with room for ``max_length`` tokens (made anew when it has not)."""
    sessions, weights = sessions_of(model)  # (dropped if the model's tensors moved: see decode.session_for)
    capacity = min(model.config.max_position_embeddings, -(-max_length // CAPACITY_ROUND) * CAPACITY_ROUND)
    graph = sessions.get((KEY, rows))
    if graph is None or graph.capacity < capacity:
        sessions.pop((KEY, rows), None)
        del graph
        graph = sessions[(KEY, rows)] = ForwardGraph(model, forward, rows, capacity, weights)
    sessions.touch((KEY, rows))
    return graph


def forward_over_fused_cache(model):
    """A wrapper of ``model.forward`` (same signature for transformers' inspection) that runs calls bringing a
    FusedCache through it; every other call goes to the model's own forward."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if args or not isinstance(cache, FusedCache):
            return original(*args, **kwargs)
        unsupported = [k for k in ("inputs_embeds", "labels", "output_attentions", "output_hidden_states")
                       if kwargs.get(k) is not None and kwargs.get(k) is not False]
        if unsupported:
            raise FuseInferError(f"FusedCache forward does not take {unsupported}")
        logits = cache.forward(model, kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids"),
                               kwargs.get("logits_to_keep", 0))
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)

    return forward
