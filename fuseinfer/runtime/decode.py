"""Fast decode for patched models: a static KV cache and the whole decode step replayed as CUDA graphs.

``generate(model, input_ids, ...)`` runs the prompt once (eager), then the new tokens by replaying graphs
captured per batch-size bucket (1, 2, 4, 8, ...): one of a single step and one of ``graph_steps`` steps in a
row (the model's :class:`~fuseinfer.RuntimeConfig`; fewer when the session's calls decode fewer; 1: only the
single step), replayed while that many tokens are left. A step is all layers (one persistent kernel,
``fuseinfer::opt_decode_step``, where the model family has one and the bucket fits it; else the patched modules
op by op; ``RuntimeConfig.decode_kernel`` picks: ``auto`` where it is faster, ``on`` wherever it applies, ``off``
never; ``session.path`` says which), the LM head, the next-token choice (greedy or
sampling), the EOS bookkeeping and the advance of every position counter (these three in one kernel,
``fuseinfer::emit_tokens``), all inside the graph, so the host only launches replays and looks at the stop flag
once ``STOP_CHECK_EVERY`` or more steps ran since it last looked. Within a graph the step kernel and the token
choice are chained with programmatic dependent launch, so a step's weight stream starts while the previous token
is being chosen. On CPU, or with ``RuntimeConfig(cuda_graphs=False)``, the same step runs eagerly over the same
static cache. The model's RuntimeConfig is the one it was patched with (``PatchConfig.runtime``); ``set_runtime``
changes it (and drops the sessions built under the old one).

Sessions (graphs and step buffers) stay on the model between calls, so repeated calls reuse them and allocate
nothing. A session serves one setting (token rule, logits processors, EOS, pad); a batch bucket keeps up to
``SESSIONS_PER_BUCKET`` of them (least recently used dropped first), all over the bucket's one KV cache (calls are
serialised per model, and each call's prefill rewrites the cache and its mask), so that callers who alternate
settings (``model.generate`` with the generation config's EOS / pad, ``fuseinfer.generate`` without) do not rebuild
a session and capture its graphs at every call. A session's decode graphs are captured by the first call that
decodes (one that makes a single token needs none). Sessions live until the model's tensors move (``model.to``: a
session records where they were, and the next call drops every session); ``release(model)`` (or
``fuseinfer.unpatch``) frees them. ``COUNTS`` counts sessions built and graphs captured (tests, benchmarks).

A call's logits processors (``processors.py``: repetition penalty, n-gram and bad-word bans, min length, suppressed
tokens) and warpers run inside the step before the token choice; its argument checks are ``args.prepare_call``'s;
a streamer and stop strings are served at the stop checks (``host_watch.py``). Calls on one model are serialised
by ``model_lock(model)``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref

import torch

from fuseinfer.core.config import RuntimeConfig
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.emit_tokens import emit_tokens, emit_tokens_scratch
from fuseinfer.core import decode_plan
from fuseinfer.core.state import (  # noqa: F401 (re-exported)
    STATE_ATTR, model_lock, patch_state, runtime_config, unwrapped,
)
from fuseinfer.runtime.args import (  # noqa: F401 (re-exported)
    Call, Sampling, decode_forward, eos_tensor, in_vocabulary, pad_id, prepare_call,
)
# (COUNTS: re-exported for tests and benchmarks)
from fuseinfer.runtime.cache import COUNTS, StaticKVCache, kv_bytes, kv_cache
from fuseinfer.runtime.graphs import capture_stream
from fuseinfer.runtime.probe import forget as forget_probe, one_check, probe
from fuseinfer.runtime.processors import Processors, Rule

SESSIONS_ATTR = "_fuseinfer_sessions"
STOP_CHECK_EVERY = 16
CAPACITY_ROUND = 128
# sampling by fuseinfer::sample_tokens, one op per step: "cuda" (the default) on CUDA, where it is faster than the
# warpers, while the CPU draws with torch.multinomial as transformers does (its tokens under one seed); True on every
# device; False nowhere (the warpers as PyTorch ops and the exponential race). Tests and benchmarks set it.
FUSED_SAMPLING = "cuda"
SESSIONS_PER_BUCKET = 4  # settings kept per batch bucket (each: its step buffers, processors, decode graphs)
CPU_CACHE_BUDGET = 512 << 20  # KV-cache bytes a model keeps between calls on the CPU (set_cache_budget)
CUDA_CACHE_FRACTION = 2  # ... on a GPU: its memory / this
_budget: list = [None]  # set_cache_budget's value (None: the defaults above)


class _Session:
    """Static cache, step buffers and (on CUDA) the captured decode graphs for one batch bucket."""

    def __deepcopy__(self, memo):  # a deep copy of the model starts without sessions (graphs cannot be copied)
        return None

    def __reduce__(self):  # so does a pickled (torch.save) model
        return type(None), ()

    def __init__(self, model, forward, bucket: int, capacity: int, sampling: Sampling, max_new: int,
                 eos: torch.Tensor, pad: int, weights: tuple, cache: StaticKVCache | None = None,
                 rule: Rule = Rule()):
        """cache: a cache of this bucket and capacity to reuse (a session it belonged to is no longer run);
        rule: the logits processors and per-step outputs the graphs include (processors.py)."""
        cfg, p = model.config, next(model.parameters())
        family = patch_state(model).family
        kv_heads, head_dim = family.kv_layout(cfg)
        # (the model holds its sessions: a weak reference back keeps it free of reference cycles)
        self.model, self.forward, self.bucket, self.capacity = weakref.proxy(model), forward, bucket, capacity
        self.sampling, self.pad, self.rule = sampling, pad, rule
        self.max_new = -(-max_new // CAPACITY_ROUND) * CAPACITY_ROUND  # room for a later call's few more tokens
        runtime = runtime_config(model)
        self.graph_steps = runtime.graph_steps  # the most steps per replay of the longer graph
        self.group = self._group_steps(max_new)  # steps per replay of the longer graph
        dev = p.device
        # placed (accelerate) or tensor-parallel models: fuseinfer/parallel
        plan = decode_plan.plan(model, family.decoder_layers(model))
        self.cache = cache if cache is not None else kv_cache(
            model, plan, cfg.num_hidden_layers, bucket, kv_heads, head_dim, capacity, p.dtype, dev)
        self.weights = weights  # _weights_key(model): where the tensors the graphs read were (see session_for)
        self.eos_host = eos  # (n_eos,) int64 on the CPU, may be empty: what fits() compares
        self.eos = eos.to(dev)
        self.tokens = torch.zeros(bucket, 1, dtype=torch.long, device=dev)  # (B, 1) next input
        self.positions = torch.zeros(bucket, 1, dtype=torch.long, device=dev)  # (B, 1) its OPT position
        self.q_start = torch.zeros(bucket, dtype=torch.int32, device=dev)  # (B,) its cache slot
        self.decode_idx = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) same slot, where the cache writes k/v
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) index into out
        self.slots = torch.arange(capacity, device=dev)  # (T,) cache slots: a prefill of P writes slots[:P]
        self.unfinished = torch.ones(bucket, dtype=torch.bool, device=dev)  # (B,)
        self.out = torch.full((bucket, self.max_new), pad, dtype=torch.long, device=dev)  # (B, max_new)
        self.alive = torch.ones(self.max_new, dtype=torch.bool, device=dev)  # any row unfinished after step i
        self.scratch = emit_tokens_scratch(bucket, dev)
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) the call's sampling seed (set by begin)
        vocab = model.get_output_embeddings().out_features
        self.proc = Processors(rule, bucket, capacity, vocab, dev) if rule.active else None
        # per-step outputs of return_dict_in_generate, (B, max_new, V) fp32, only when asked for
        self.scores_out = torch.zeros(bucket, self.max_new, vocab, device=dev) if rule.output_scores else None
        self.logits_out = torch.zeros(bucket, self.max_new, vocab, device=dev) if rule.output_logits else None
        # sampling in one pass (fuseinfer::sample_tokens) unless the warped scores are asked for
        fused = FUSED_SAMPLING is True or (FUSED_SAMPLING == "cuda" and dev.type == "cuda")
        self.fused_sampling = fused and sampling.do_sample and self.scores_out is None
        self.batch = bucket  # real rows of the current call (set by begin)
        # The decode step: one kernel for the whole model where it has one, else the patched modules per op
        if plan.no_kernel:
            self.step_kernel, why = None, plan.no_kernel
        else:
            self.step_kernel, why = patch_state(model).family.decode_step_kernel(model, self.cache)
        self.path = f"one kernel per step ({self.step_kernel.op})" if why is None else f"per op ({why})"
        self.path += f"; eager, {plan.no_graphs}" if plan.no_graphs else ""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # steps per replay -> graph
        self.capture_mode = plan.capture_mode
        self.graphs_on = _graphs_enabled(dev, plan, runtime)  # decode graphs: captured by the first call that decodes
        COUNTS["session"] += 1
        if self.graphs_on and max_new > 1:  # (a caller of begin/advance, e.g. the eval, gets them at once)
            self._capture(self.group)  # (decode steps: max_new - 1)

    def fits(self, capacity: int, sampling: Sampling, max_new: int, eos: torch.Tensor, pad: int,
             rule: Rule = Rule()) -> bool:
        """Whether this session serves a call: room enough, a long enough graph, the same token rule."""
        return (self.capacity >= capacity and self.max_new >= max_new
                and (not self.graphs or self.group >= self._group_steps(max_new))
                and self.settings == settings_key(sampling, rule, eos, pad))

    @property
    def settings(self) -> tuple:
        """What the session's graphs bake in besides sizes (its key in the bucket's LRU)."""
        return settings_key(self.sampling, self.rule, self.eos_host, self.pad)

    def _group_steps(self, max_new: int) -> int:
        """Steps in the longer graph for ``max_new`` new tokens (its decode steps are max_new - 1)."""
        return min(self.graph_steps, max(1, max_new - 1))

    def _emit(self, logits: torch.Tensor) -> None:
        """Choose the next tokens from logits (B, V), record them and the stop state at ``step``, advance every
        counter (one kernel on CUDA: fuseinfer::emit_tokens). Before the choice: the call's logits processors and
        warpers in transformers' order, and the per-step outputs where asked for. Sampling without output_scores:
        the warpers and the draw are one op (fuseinfer::sample_tokens, Philox keyed by the call's seed at the step
        counter), whose tokens emit_tokens records."""
        scores = self.proc(logits, self.step) if self.proc is not None else logits
        if self.fused_sampling:
            chosen = self.sampling.sample(scores, self.seed, self.step)  # (B,)
            if self.logits_out is not None:
                self.logits_out.index_copy_(1, self.step, logits[:, None])
            emit_tokens(scores, self.eos, self.pad, self.tokens, self.positions, self.q_start, self.decode_idx,
                        self.step, self.unfinished, self.out, self.alive, self.scratch, chosen)
            return
        scores = self.sampling.warp(scores)
        if self.scores_out is not None:
            self.scores_out.index_copy_(1, self.step, scores[:, None])
        if self.logits_out is not None:
            self.logits_out.index_copy_(1, self.step, logits[:, None])
        emit_tokens(self.sampling.choose(scores, self.batch), self.eos, self.pad, self.tokens, self.positions,
                    self.q_start, self.decode_idx, self.step, self.unfinished, self.out, self.alive, self.scratch)

    def _decode_step(self) -> None:
        """One token for every row; advances all counters (everything here is captured in the graph)."""
        if self.proc is not None:  # the input tokens join the history the processors read (at their slot)
            self.proc.record(self.tokens, self.decode_idx)
        if self.step_kernel is not None:  # writes k/v at q_start, which equals decode_idx for every row
            logits = self.step_kernel(self.tokens, self.positions, self.q_start)
        else:
            self.cache.write_idx = self.decode_idx
            logits = self.forward(self.model, self.tokens, self.positions, self.cache, self.q_start)
        self._emit(logits)

    def _capture(self, steps: int) -> None:
        """Graphs of one step and (steps > 1) of ``steps`` steps in a row, sharing one memory pool. The warm-up
        steps run for real: the counters are reset first, so that they write cache slots 0 and 1 and
        out[:, 0] whatever the last call left (a deferred capture follows a call whose decode_idx may sit at the
        cache's end); the next begin() rewrites all of it."""
        COUNTS["decode_graphs"] += 1
        self.group = steps
        for t in (self.positions, self.q_start, self.decode_idx, self.step):
            t.zero_()
        self.graphs = capture_graphs(self._decode_step, sorted({1, steps}), self.step, self.capture_mode)

    def begin(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill left-padded input_ids, mask (B, P) into the cache (mask None: no padding); returns the first new
        tokens (B, 1). Only what the prefill reads is written before it is launched: on an idle GPU the host time
        before that launch adds to the call's latency, while what follows it overlaps the prefill."""
        b, p = input_ids.shape
        dev = self.tokens.device
        full = b == self.bucket  # (no padding rows: fewer launches before the prefill, whose host time users wait)
        if mask is not None:
            mask = mask.long()  # (B, P)
        if full and input_ids.dtype == torch.long:
            ids = input_ids  # (read only)
        else:
            ids = torch.full((self.bucket, p), self.pad, dtype=torch.long, device=dev)
            ids[:b] = input_ids
        key_mask = self.cache.key_mask
        if mask is None:  # every prompt slot and the generated ones (the causal bound hides those not written yet)
            key_mask[:b].fill_(True)
        else:
            key_mask[:b, :p].copy_(mask)  # (to bool)
            key_mask[:b, p:] = True  # generated slots; the causal bound hides those not written yet
        if not full:
            key_mask[b:].zero_()
        if mask is None:  # positions 0 .. P-1 on every real row: the cache's slot numbers, as OPT counts them
            pos = self.slots[:p].expand(self.bucket if full else b, p)  # (B, P)
            if self.bucket > 1:
                pos = pos.contiguous()
            real = None
        else:
            real = mask.cumsum(1)  # (B, P) real tokens up to each position
            pos = real * mask - 1  # (B, P), -1 on padding, as OPT does
        if not full:
            pos = torch.cat([pos, pos.new_full((self.bucket - b, p), -1)])  # (Bb, P): the bucket's padding rows
        self.cache.write_idx = self.slots[:p]  # prefill writes slots [0, P) in one eager pass
        self.q_start.zero_()
        # graph / lean loop / patched modules (advances counters: reset below)
        from fuseinfer.runtime.prefill import session_prefill
        self.cache.calibrate = True  # (an FP8 cache: the prompt's k/v set its scales; the decode steps keep them)
        try:
            logits = session_prefill(self, ids, pos)
        finally:
            self.cache.calibrate = False
        # what only the token choice and the decode steps read, queued behind the prefill
        self.unfinished.fill_(True)
        if not full:
            self.unfinished[b:] = False
        if self.fused_sampling:  # from torch's generator, so that torch.manual_seed makes the call reproducible
            self.seed.copy_(torch.randint(2**62, (1,)))
        self.out.fill_(self.pad)
        self.alive.fill_(True)
        self.step.zero_()
        if self.proc is not None:
            self.proc.begin(ids[:b], torch.ones_like(ids[:b]) if mask is None else mask.to(dev), self.bucket)
        self.batch = b  # (the first token's draw covers the call's rows only)
        self._emit(logits)
        # decode: the first input sits at slot P with position = number of real prompt tokens
        if real is None:
            self.positions[:b].fill_(p)
        else:
            self.positions[:b, 0] = real[:, -1]  # (= mask.sum(1))
        if not full:
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

    def run(self, input_ids: torch.Tensor, mask: torch.Tensor | None, max_new: int, watch=None) -> torch.Tensor:
        """input_ids, mask: (B, P) left-padded (mask None: no padding) -> generated tokens (B, n <= max_new).
        ``watch``: a :class:`~fuseinfer.runtime.host_watch.HostWatch` (streamer, stop strings) that looks at the
        tokens at every stop check instead of the device's stop flag, and makes the result."""
        if self.graphs_on and not self.graphs and max_new > 1:  # the session's first call that decodes
            self._capture(self._group_steps(max_new))
        self.begin(input_ids, mask)
        group = max(self.graphs, default=1)  # steps per replay while that many are left
        i, unchecked = 1, 0  # tokens so far, steps since the last stop check
        while i < max_new:
            if unchecked >= STOP_CHECK_EVERY:
                unchecked = 0
                if (watch.check(self, i) if watch is not None else not bool(self.alive[i - 1])):
                    break
            n = group if max_new - i >= group else 1
            self.advance(n)
            i, unchecked = i + n, unchecked + n
        if watch is not None:
            return watch.finish(self, i)
        if max_new == 1:  # the first token is made whatever it is: no stop flag to read (nor a sync to wait on)
            return self.out[:self.batch, :1]
        alive = self.alive[:max_new].cpu()
        n = int(alive.logical_not().nonzero()[0]) + 1 if not alive.all() else max_new
        return self.out[:self.batch, :n]




def capture_graphs(step, counts: list, step_counter: torch.Tensor, mode: str) -> dict:
    """{n: CUDA graph of ``step()`` n times in a row} for n in ``counts``, one memory pool, after two warm-up
    steps on a side stream (allocator, cuBLAS handles, kernels); ``step_counter`` is zeroed before each warm-up
    step and before the capture, so the warm-up writes stay in out[:, 0]. (Tests on the CPU stand in an eager
    replay here.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step_counter.zero_()  # keep the writes inside out[:, 0], whatever max_new is
            step()
    torch.cuda.current_stream().wait_stream(side)
    step_counter.zero_()
    graphs, pool = {}, None
    for n in counts:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(graph, step_counter.device),
                              capture_error_mode=mode):
            for _ in range(n):
                step()
        pool = graph.pool()
        graphs[n] = graph
    return graphs


def _graphs_enabled(dev: torch.device, plan, runtime: RuntimeConfig) -> bool:
    """Whether sessions on ``dev`` replay CUDA graphs (tests on the CPU stand in a fake capture here)."""
    return dev.type == "cuda" and runtime.cuda_graphs and not plan.no_graphs


def settings_key(sampling: Sampling, rule: Rule, eos: torch.Tensor, pad: int) -> tuple:
    """A session's settings as a hashable key: (token rule, processors, EOS ids, pad id)."""
    return sampling, rule, tuple(eos.tolist()), int(pad)


def _bucket(batch: int) -> int:
    return 1 << (batch - 1).bit_length()


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id=None, pad_token_id: int | None = None, **settings):
    """Generate with the static cache and CUDA-graph decode; returns (B, P + n) token ids like HF generate.

    ``model`` must be patched with all ops. Prompts must be left-padded (or not padded). Generation stops
    after ``max_new_tokens`` or once every row has produced an EOS (rows that finished get ``pad_token_id``).
    ``settings``: transformers' ``min_p``, ``min_new_tokens``, ``min_length``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``bad_words_ids``, ``suppress_tokens``, ``begin_suppress_tokens``,
    ``stop_strings`` (with ``tokenizer``), ``streamer`` (handed chunks of about ``STOP_CHECK_EVERY`` tokens),
    ``return_dict_in_generate`` with ``output_scores`` / ``output_logits`` (see docs/generate.md). Calls on one
    model from several threads run one at a time (``model_lock``).
    """
    model = unwrapped(model)  # a torch.compile wrapper: the model it wraps
    with model_lock(model), one_check(model):  # (the probe checks the model once for the call: probe.py)
        call = prepare_call(model, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
                            eos_token_id, pad_token_id, **settings)
        if not isinstance(call, Call):
            raise FuseInferError(call.message)
        return run_call(model, input_ids, call)


def run_call(model, input_ids: torch.Tensor, call: Call, dev: torch.device | None = None):
    """Run a checked call (``prepare_call``) on the fast path; the caller holds ``model_lock(model)``. ``dev``: the
    device of the model's first parameter where the caller knows it."""
    if call.streamer is not None:
        call.streamer.put(input_ids.cpu())  # the prompt first, as transformers does
    if call.max_new < 1:
        if call.streamer is not None:
            call.streamer.end()
        return _result(call, input_ids, None, 0, None)
    b, p = input_ids.shape
    if dev is None:
        dev = next(model.parameters()).device
    watch = None
    if call.streamer is not None or call.stop_strings is not None:
        from fuseinfer.runtime.host_watch import HostWatch

        watch = HostWatch(input_ids, call.eos, call.pad, call.streamer, call.stop_strings)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # graphs on the model's GPU
        session = session_for(model, call.forward, b, p + call.max_new, call.sampling, call.max_new, call.eos,
                              call.pad, call.rule)
        new = session.run(input_ids.to(dev), None if call.mask is None else call.mask.to(dev), call.max_new, watch)
        out = _result(call, input_ids, new, new.shape[1], session)
        if dev.type == "cuda":  # the result is copied out of the session's buffers before the next caller runs
            torch.cuda.current_stream(dev).synchronize()
        del new, session
        trim_sessions(model, dev)
    return out


def _result(call: Call, input_ids: torch.Tensor, new, n: int, session):
    """The token ids (B, P + n), or transformers' GenerateDecoderOnlyOutput for return_dict_in_generate."""
    sequences = input_ids if new is None else torch.cat([input_ids, new.to(input_ids.device)], dim=1)
    if not call.return_dict:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    def steps(buf):
        if buf is None or session is None:
            return None
        return tuple(buf[:session.batch, t].clone() for t in range(n))  # (B, V) fp32 per step

    return GenerateDecoderOnlyOutput(sequences=sequences,
                                     scores=steps(session.scores_out) if call.rule.output_scores else None,
                                     logits=steps(session.logits_out) if call.rule.output_logits else None,
                                     attentions=None, hidden_states=None, past_key_values=None)


class _Sessions(dict):
    """A model's fast-decode state (``model.__dict__[SESSIONS_ATTR]``): batch bucket -> the session its last call
    ran, ("hf", rows) -> the middle path's ForwardGraph (hf_cache.py). ``lru[bucket]``: every session of that
    bucket by settings (``settings_key``), least recently used first, at most SESSIONS_PER_BUCKET, all over one
    cache. The sessions do not reference each other or this dict (no reference cycle through the model).
    ``plans``: the patched ``model.generate``'s resolved fast-path calls by their arguments (``hf_generate.py``)."""

    def __init__(self):
        super().__init__()
        self.lru: dict[int, collections.OrderedDict] = {}
        self.recent: collections.OrderedDict = collections.OrderedDict()  # every key, least recently used first
        self.plans: collections.OrderedDict = collections.OrderedDict()  # least recently used first

    def clear(self) -> None:
        super().clear()
        self.lru.clear()
        self.recent.clear()
        self.plans.clear()

    def drop_bucket(self, bucket: int) -> None:
        """Free a bucket's sessions (graphs, buffers) and its cache."""
        self.pop(bucket, None)
        self.lru.pop(bucket, None)

    def touch(self, key) -> None:
        """Record that a call uses ``key`` (a bucket, or ``("hf", rows)``): the last to go when trimming."""
        self.recent.pop(key, None)
        self.recent[key] = None

    def trim(self, budget: int) -> None:
        """Keep the most recently used buckets and graphs whose caches fit in ``budget`` bytes together; free the
        others (one that alone exceeds the budget is freed, whatever its turn)."""
        kept = 0
        for key in reversed(list(self.recent)):
            entry = self.get(key)
            size = _cache_bytes(entry.cache) if entry is not None else 0
            if entry is not None and kept + size <= budget:
                kept += size
                continue
            self.recent.pop(key)
            if isinstance(key, int):
                self.drop_bucket(key)
            else:
                self.pop(key, None)

    def __deepcopy__(self, memo):  # a deep copy of the model starts without sessions (graphs cannot be copied)
        return _Sessions()

    def __reduce__(self):  # so does a pickled (torch.save) model
        return _Sessions, ()


_sizes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # cache -> kv_bytes (its buffers keep their sizes)


def _cache_bytes(cache) -> int:
    """``kv_bytes(cache)``, computed once per cache (each call's trim reads it; a cache is replaced, not resized)."""
    try:
        size = _sizes.get(cache)
        if size is None:
            size = _sizes[cache] = kv_bytes(cache)
        return size
    except TypeError:  # (a cache without weak references)
        return kv_bytes(cache)


def sessions_of(model) -> tuple[_Sessions, tuple]:
    """(the model's sessions, its weights key), every session dropped first if the model's tensors moved."""
    sessions = model.__dict__.get(SESSIONS_ATTR)
    if not isinstance(sessions, _Sessions):
        sessions = model.__dict__[SESSIONS_ATTR] = _Sessions()
    weights = _weights_key(model)
    if any(s is not None and getattr(s, "weights", weights) != weights for s in sessions.values()):
        sessions.clear()  # the model's tensors moved: every bucket's cache and graphs belong to the old ones
    return sessions, weights


def session_for(model, forward, batch: int, max_len: int, sampling: Sampling, max_new: int, eos: torch.Tensor,
                pad: int, rule: Rule = Rule()) -> _Session:
    """The model's session for this batch bucket and these settings. Made anew only when none of the bucket's
    sessions has these settings (then over the bucket's cache), when the one that has them is too short for
    max_new (the same), or when the bucket's cache is too small (then every session of the bucket goes, and a
    larger cache comes)."""
    capacity = min(model.config.max_position_embeddings, -(-max_len // CAPACITY_ROUND) * CAPACITY_ROUND)
    sessions, weights = sessions_of(model)
    bucket = _bucket(batch)
    lru = sessions.lru.setdefault(bucket, collections.OrderedDict())
    key = settings_key(sampling, rule, eos, pad)
    session = lru.get(key)
    if session is not None and session.fits(capacity, sampling, max_new, eos, pad, rule):
        lru.move_to_end(key)
        sessions[bucket] = session
        sessions.touch(bucket)
        return session
    current = sessions.get(bucket)  # (None in a deep or pickled copy of the model: see _Session)
    cache = current.cache if current is not None else None
    if cache is not None and current.capacity < capacity:
        cache = None  # too small: every session of the bucket reads it (graphs, step kernel)
    if cache is None:
        sessions.drop_bucket(bucket)  # free the old graphs and cache before allocating anew
        lru = sessions.lru[bucket] = collections.OrderedDict()
        COUNTS["cache"] += 1
    else:
        capacity = current.capacity
        lru.pop(key, None)  # (too short for max_new, or none has these settings)
        while len(lru) >= SESSIONS_PER_BUCKET:
            lru.popitem(last=False)
    del session, current
    session = _Session(model, forward, bucket, capacity, sampling, max_new, eos, pad, weights, cache, rule)
    lru[key] = sessions[bucket] = session
    sessions.touch(bucket)
    return session


def set_cache_budget(nbytes: int | None) -> None:
    """How many bytes of KV cache fast decode keeps on a model between calls (``None``: the default, half of
    the GPU's memory, 512 MiB on the CPU). When a ``generate`` call returns, the most recently used batch buckets'
    caches (and the middle path's graphs') that fit in the budget together stay, the others are freed: a call
    whose cache alone is larger frees it on return, so one large batch does not hold its memory until
    ``release``."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise FuseInferError(f"set_cache_budget takes a number of bytes >= 0 or None, got {nbytes!r}")
    _budget[0] = nbytes


def cache_budget(device: torch.device) -> int:
    """The KV-cache bytes a model on ``device`` keeps between calls (``set_cache_budget``)."""
    if _budget[0] is not None:
        return _budget[0]
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // CUDA_CACHE_FRACTION
    return CPU_CACHE_BUDGET


def trim_sessions(model, dev: torch.device | None = None) -> None:
    """Apply the cache budget to ``model``'s sessions at the end of a call (the caller holds ``model_lock``).
    ``dev``: the device of the model's first parameter where the caller knows it."""
    sessions = model.__dict__.get(SESSIONS_ATTR)
    if isinstance(sessions, _Sessions):
        sessions.trim(cache_budget(next(model.parameters()).device if dev is None else dev))


def _weights_key(model) -> tuple:
    """Where and how the model's tensors are stored: a session's graphs and step kernel read them there. Checked at
    every call through the model's probe (``probe.py``), which redoes the walk over the modules only when cheaper
    evidence (identity of every module dict's entries, every tensor's address and dtype) says something changed."""
    return probe(model).key


def set_runtime(model, runtime: RuntimeConfig | None = None, **changes) -> RuntimeConfig:
    """Make a patched ``model`` run with ``runtime`` (default: its current RuntimeConfig) with the fields
    ``changes`` replaced, e.g. ``set_runtime(model, prefill="lean")``; returns the RuntimeConfig it had. The
    sessions built under the old one (their step, graphs and graph length) are released, so the next call builds
    them anew."""
    model = unwrapped(model)
    with model_lock(model):
        state = patch_state(model)
        if state is None:
            raise FuseInferError("set_runtime needs a patched model: call fuseinfer.patch(model) first (or patch "
                                 "with fuseinfer.PatchConfig(runtime=fuseinfer.RuntimeConfig(...)))")
        if runtime is not None and not isinstance(runtime, RuntimeConfig):
            raise FuseInferError(f"set_runtime takes a fuseinfer.RuntimeConfig, got {runtime!r}")
        names = [f.name for f in dataclasses.fields(RuntimeConfig)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise FuseInferError(f"unknown RuntimeConfig field(s) {unknown}; choose from {names}")
        old = state.config.runtime
        new = dataclasses.replace(old if runtime is None else runtime, **changes)
        object.__setattr__(model, STATE_ATTR, state._replace(config=dataclasses.replace(state.config, runtime=new)))
        release(model)
        return old


@contextlib.contextmanager
def using_runtime(model, **changes):
    """Within the block, a patched ``model`` runs with these RuntimeConfig fields changed (``set_runtime``); its
    RuntimeConfig is restored after it (and the sessions built within released)."""
    old = set_runtime(model, **changes)
    try:
        yield
    finally:
        set_runtime(model, old)


def release(model) -> None:
    """Free the caches and graphs fast decode keeps on ``model`` (or on the model a torch.compile wrapper holds);
    waits for a generate call running on it to finish."""
    model = unwrapped(model)
    with model_lock(model):
        model.__dict__.pop(SESSIONS_ATTR, None)
        forget_probe(model)
