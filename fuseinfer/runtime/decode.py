"""Fast decode for patched models: a static KV cache and the whole decode step replayed as CUDA graphs.

``generate(model, input_ids, ...)`` runs the prompt once (eager), then the new tokens by replaying graphs
captured per batch-size bucket (1, 2, 4, 8, ...): one of a single step and one of ``GRAPH_STEPS`` steps in a
row (FUSEINFER_DECODE_GRAPH_STEPS; fewer when the session's calls decode fewer; 1: only the single step),
replayed while that many tokens are left. A step is all layers (one persistent kernel,
``fuseinfer::opt_decode_step``, where the model family has one and the bucket fits it; else the patched modules
op by op; FUSEINFER_DECODE_KERNEL picks: ``auto`` where it is faster, ``1`` wherever it applies, ``0`` never;
``session.path`` says which), the LM head, the next-token choice (greedy or
sampling), the EOS bookkeeping and the advance of every position counter (these three in one kernel,
``fuseinfer::emit_tokens``), all inside the graph, so the host only launches replays and looks at the stop flag
once ``STOP_CHECK_EVERY`` or more steps ran since it last looked. Within a graph the step kernel and the token
choice are chained with programmatic dependent launch, so a step's weight stream starts while the previous token
is being chosen. On CPU, or with FUSEINFER_CUDA_GRAPHS=0, the same step runs eagerly over the same static cache.

Sessions (cache + graphs, one per bucket) stay on the model between calls, so repeated calls reuse them and
allocate nothing, until the model's tensors move (``model.to``: a session records where they were, and the next
call drops every session); ``release(model)`` (or ``fuseinfer.unpatch``) frees them.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass

import torch

from .. import knobs
from ..config import OPS
from ..errors import FuseInferError
from ..ops.emit_tokens import emit_tokens, emit_tokens_scratch
from ..parallel import decode_plan
from ..state import patch_state, unwrapped
from .cache import StaticKVCache

SESSIONS_ATTR = "_fuseinfer_sessions"
STOP_CHECK_EVERY = 16
GRAPH_STEPS = 16  # steps per replay of the longer graph (FUSEINFER_DECODE_GRAPH_STEPS)
CAPACITY_ROUND = 128


@dataclass(frozen=True)
class Sampling:
    """Next-token rule: greedy, or sampling after temperature, top-k and top-p (transformers' order)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) fp32 -> scores (B, V) whose first maximum per row is the next token."""
        if not self.do_sample:
            return logits
        logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1)  # ascending, like TopPLogitsWarper
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum <= 1 - self.top_p
            drop[:, -1] = False  # keep at least the most likely token
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        probs = logits.softmax(-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), samples from p and is CUDA-graph safe
        return probs / torch.empty_like(probs).exponential_()


class _Session:
    """Static cache, step buffers and (on CUDA) the captured decode graphs for one batch bucket."""

    def __deepcopy__(self, memo):  # a deep copy of the model starts without sessions (graphs cannot be copied)
        return None

    def __reduce__(self):  # so does a pickled (torch.save) model
        return type(None), ()

    def __init__(self, model, forward, bucket: int, capacity: int, sampling: Sampling, max_new: int,
                 eos: torch.Tensor, pad: int, weights: tuple, cache: StaticKVCache | None = None):
        """cache: a cache of this bucket and capacity to reuse (a session it belonged to is no longer run)."""
        cfg, p = model.config, next(model.parameters())
        heads = cfg.num_attention_heads
        # (the model holds its sessions: a weak reference back keeps it free of reference cycles)
        self.model, self.forward, self.bucket, self.capacity = weakref.proxy(model), forward, bucket, capacity
        self.sampling, self.pad = sampling, pad
        self.max_new = -(-max_new // CAPACITY_ROUND) * CAPACITY_ROUND  # room for a later call's few more tokens
        self.group = _group_steps(max_new)  # steps per replay of the longer graph
        dev = p.device
        plan = decode_plan.plan(model)  # placed (accelerate) or tensor-parallel models: fuseinfer/parallel
        self.cache = cache if cache is not None else decode_plan.kv_cache(
            model, plan, cfg.num_hidden_layers, bucket, heads, cfg.hidden_size // heads, capacity, p.dtype, dev)
        self.weights = weights  # _weights_key(model): where the tensors the graphs read were (see session_for)
        self.eos_host = eos  # (n_eos,) int64 on the CPU, may be empty: what fits() compares
        self.eos = eos.to(dev)
        self.tokens = torch.zeros(bucket, 1, dtype=torch.long, device=dev)  # (B, 1) next input
        self.positions = torch.zeros(bucket, 1, dtype=torch.long, device=dev)  # (B, 1) its OPT position
        self.q_start = torch.zeros(bucket, dtype=torch.int32, device=dev)  # (B,) its cache slot
        self.decode_idx = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) same slot, where the cache writes k/v
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) index into out
        self.unfinished = torch.ones(bucket, dtype=torch.bool, device=dev)  # (B,)
        self.out = torch.full((bucket, self.max_new), pad, dtype=torch.long, device=dev)  # (B, max_new)
        self.alive = torch.ones(self.max_new, dtype=torch.bool, device=dev)  # any row unfinished after step i
        self.scratch = emit_tokens_scratch(bucket, dev)
        self.batch = bucket  # real rows of the current call (set by begin)
        # The decode step: one kernel for the whole model where it has one, else the patched modules per op
        self.step_kernel, why = (None, plan.no_kernel) if plan.no_kernel else \
            patch_state(model).family.decode_step_kernel(model, self.cache)
        self.path = "one kernel per step (fuseinfer::opt_decode_step)" if why is None else f"per op ({why})"
        self.path += f"; eager, {plan.no_graphs}" if plan.no_graphs else ""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # steps per replay -> graph
        self.capture_mode = plan.capture_mode
        if dev.type == "cuda" and knobs.get("FUSEINFER_CUDA_GRAPHS") != "0" and not plan.no_graphs:
            self._capture(self.group)  # (decode steps: max_new - 1)

    def fits(self, capacity: int, sampling: Sampling, max_new: int, eos: torch.Tensor, pad: int) -> bool:
        """Whether this session serves a call: room enough, a long enough graph, the same token rule."""
        return (self.capacity >= capacity and self.max_new >= max_new
                and (not self.graphs or self.group >= _group_steps(max_new))
                and self.sampling == sampling
                and self.pad == pad and torch.equal(self.eos_host, eos))

    def _emit(self, logits: torch.Tensor) -> None:
        """Choose the next tokens from logits (B, V), record them and the stop state at ``step``, advance every
        counter (one kernel on CUDA: fuseinfer::emit_tokens)."""
        emit_tokens(self.sampling.scores(logits), self.eos, self.pad, self.tokens, self.positions, self.q_start,
                    self.decode_idx, self.step, self.unfinished, self.out, self.alive, self.scratch)

    def _decode_step(self) -> None:
        """One token for every row; advances all counters (everything here is captured in the graph)."""
        if self.step_kernel is not None:  # writes k/v at q_start, which equals decode_idx for every row
            logits = self.step_kernel(self.tokens, self.positions, self.q_start)
        else:
            self.cache.write_idx = self.decode_idx
            logits = self.forward(self.model, self.tokens, self.positions, self.cache, self.q_start)
        self._emit(logits)

    def _capture(self, steps: int) -> None:
        """Graphs of one step and (steps > 1) of ``steps`` steps in a row, sharing one memory pool."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, cuBLAS handles, kernels)
            for _ in range(2):
                self.step.zero_()  # keep the writes inside out[:, 0], whatever max_new is
                self._decode_step()
        torch.cuda.current_stream().wait_stream(side)
        self.step.zero_()
        pool = None
        for n in sorted({1, steps}):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_mode):
                for _ in range(n):
                    self._decode_step()
            pool = graph.pool()
            self.graphs[n] = graph

    def begin(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Prefill left-padded input_ids, mask (B, P) into the cache; returns the first new tokens (B, 1)."""
        b, p = input_ids.shape
        dev = self.tokens.device
        ids = torch.full((self.bucket, p), self.pad, dtype=torch.long, device=dev)
        ids[:b] = input_ids
        key_mask = self.cache.key_mask
        key_mask.zero_()
        key_mask[:b, :p] = mask.bool()
        key_mask[:b, p:] = True  # generated slots; the causal bound hides those not written yet
        pos = torch.full((self.bucket, p), -1, dtype=torch.long, device=dev)
        pos[:b] = mask.long().cumsum(1) * mask - 1  # (B, P), -1 on padding, as OPT does
        self.unfinished.fill_(True)
        self.unfinished[b:] = False
        self.out.fill_(self.pad)
        self.alive.fill_(True)
        self.step.zero_()
        self.cache.write_idx = torch.arange(p, device=dev)  # prefill writes slots [0, P) in one eager pass
        self.q_start.zero_()
        from .prefill import session_prefill  # graph / lean loop / patched modules (advances counters: reset below)
        self._emit(session_prefill(self, ids, pos))
        # decode: the first input sits at slot P with position = number of real prompt tokens
        self.positions[:b, 0] = mask.long().sum(1)
        self.positions[b:] = 0
        self.q_start.fill_(p)
        self.decode_idx.fill_(p)
        self.step.fill_(1)
        self.batch = b
        return self.tokens[:b]

    def advance(self, steps: int = 1) -> torch.Tensor:
        """``steps`` decode steps for every row (on CUDA one replay of the graph of that many: 1, or ``run``'s
        group); returns the last new tokens (B, 1)."""
        if self.graphs:
            self.graphs[steps].replay()
        else:
            for _ in range(steps):
                self._decode_step()
        return self.tokens[:self.batch]

    def run(self, input_ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> torch.Tensor:
        """input_ids, mask: (B, P) left-padded -> generated tokens (B, n <= max_new)."""
        self.begin(input_ids, mask)
        group = max(self.graphs, default=1)  # steps per replay while that many are left
        i, unchecked = 1, 0  # tokens so far, steps since the last stop check
        while i < max_new:
            if unchecked >= STOP_CHECK_EVERY:
                unchecked = 0
                if not bool(self.alive[i - 1]):
                    break
            n = group if max_new - i >= group else 1
            self.advance(n)
            i, unchecked = i + n, unchecked + n
        alive = self.alive[:max_new].cpu()
        n = int(alive.logical_not().nonzero()[0]) + 1 if not alive.all() else max_new
        return self.out[:self.batch, :n]


def decode_forward(model):
    """(the fast-decode forward of ``model``, None), or (None, why ``model`` cannot take the fast path)."""
    state = patch_state(model)
    if state is None or set(state.config.ops) != set(OPS) or state.config.filter_fn is not None:
        return None, ("fuseinfer.generate needs a model patched with every op and no filter_fn: "
                      "call fuseinfer.patch(model) first")
    why = decode_plan.refusal(model)  # accelerate offload: transformers' generate runs it
    if why is not None:
        return None, why
    forward, why = state.family.decode_forward(model)
    return decode_plan.forward(model, forward), why


def _graph_steps() -> int:
    return knobs.get_int("FUSEINFER_DECODE_GRAPH_STEPS")


def _group_steps(max_new: int) -> int:
    """Steps in the longer graph of a session for ``max_new`` new tokens (its decode steps are max_new - 1)."""
    return min(_graph_steps(), max(1, max_new - 1))


def _bucket(batch: int) -> int:
    return 1 << (batch - 1).bit_length()


def eos_tensor(eos) -> torch.Tensor:
    """EOS ids as given to generate (None, an int, a list, a tensor of any shape) -> (n_eos,) int64 on the CPU."""
    if eos is None:
        return torch.empty(0, dtype=torch.long)
    return torch.as_tensor(eos, dtype=torch.long, device="cpu").flatten()


def pad_id(pad_token_id, eos: torch.Tensor) -> int:
    """The pad token fast decode uses: the given one, else the first EOS id (as transformers does), else 0."""
    return int(pad_token_id) if pad_token_id is not None else (int(eos[0]) if eos.numel() else 0)


def in_vocabulary(model, token: int) -> bool:
    """Whether ``token`` can be embedded: fast decode feeds the pad token to finished rows and to the rows of a
    batch bucket that the call does not fill."""
    return 0 <= token < model.get_input_embeddings().num_embeddings


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id=None, pad_token_id: int | None = None) -> torch.Tensor:
    """Generate with the static cache and CUDA-graph decode; returns (B, P + n) token ids like HF generate.

    ``model`` must be patched with all ops. Prompts must be left-padded (or not padded). Generation stops
    after ``max_new_tokens`` or once every row has produced an EOS (rows that finished get ``pad_token_id``).
    """
    model = unwrapped(model)  # a torch.compile wrapper: the model it wraps
    forward, why = decode_forward(model)
    if forward is None:
        raise FuseInferError(why)
    if input_ids.dim() != 2:
        raise FuseInferError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if min(input_ids.shape) == 0:
        raise FuseInferError(f"input_ids must hold at least one row of at least one token, got shape "
                             f"{tuple(input_ids.shape)}")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if mask.shape != input_ids.shape:
        raise FuseInferError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if not bool(mask[:, -1].all()):
        raise FuseInferError("fuseinfer.generate needs left padding: set tokenizer.padding_side = 'left'")
    b, p = input_ids.shape
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise FuseInferError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    limit = model.config.max_position_embeddings
    if p + max_new_tokens > limit:
        raise FuseInferError(f"prompt ({p}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"max_position_embeddings ({limit})")
    if max_new_tokens < 1:
        return input_ids
    if do_sample and not temperature > 0:  # (written so that NaN fails too)
        raise FuseInferError(f"temperature must be > 0 when do_sample=True, got {temperature!r}")
    if do_sample and top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise FuseInferError(f"top_k must be a non-negative integer (0 or None: no top-k), got {top_k!r}")
    if do_sample and top_p is not None and not 0 <= top_p <= 1:
        raise FuseInferError(f"top_p must be in [0, 1] (1 or None: no top-p), got {top_p!r}")
    sampling = Sampling(do_sample, float(temperature), top_k, top_p) if do_sample else Sampling()
    eos = eos_tensor(eos_token_id)
    pad = pad_id(pad_token_id, eos)
    if not in_vocabulary(model, pad):
        raise FuseInferError(f"pad_token_id {pad} is not a token of the model's vocabulary "
                             f"(0..{model.get_input_embeddings().num_embeddings - 1})")
    dev = next(model.parameters()).device
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # graphs on the model's GPU
        session = session_for(model, forward, b, p + max_new_tokens, sampling, max_new_tokens, eos, pad)
        new = session.run(input_ids.to(dev), mask.to(dev), max_new_tokens)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def session_for(model, forward, batch: int, max_len: int, sampling: Sampling, max_new: int, eos: torch.Tensor,
                pad: int) -> _Session:
    """The model's session for this batch bucket, made anew only when the cached one does not fit."""
    capacity = min(model.config.max_position_embeddings, -(-max_len // CAPACITY_ROUND) * CAPACITY_ROUND)
    sessions = model.__dict__.setdefault(SESSIONS_ATTR, {})
    weights = _weights_key(model)
    if any(s is not None and s.weights != weights for s in sessions.values()):
        sessions.clear()  # the model's tensors moved: every bucket's cache and graphs belong to the old ones
    bucket = _bucket(batch)
    session = sessions.get(bucket)  # (None in a deep or pickled copy of the model: see _Session)
    if session is None or not session.fits(capacity, sampling, max_new, eos, pad):
        sessions.pop(bucket, None)  # free the old graphs (and the cache, unless reused) before allocating anew
        cache = session.cache if session is not None and session.capacity >= capacity else None
        if cache is not None:  # other settings only (the token rule, EOS, pad, more new tokens): same cache
            capacity = session.capacity
        del session
        session = sessions[bucket] = _Session(model, forward, bucket, capacity, sampling, max_new, eos, pad,
                                              weights, cache)
    return session


def _weights_key(model) -> tuple:
    """Where and how the model's tensors are stored: a session's graphs and step kernel read them there."""
    return tuple((t.data_ptr(), t.dtype, t.device) for t in itertools.chain(model.parameters(), model.buffers()))


def release(model) -> None:
    """Free the caches and graphs fast decode keeps on ``model`` (or on the model a torch.compile wrapper holds)."""
    unwrapped(model).__dict__.pop(SESSIONS_ATTR, None)
