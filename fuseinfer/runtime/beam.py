"""Beam search of patched ``model.generate`` as one CUDA-graph replay per step.

transformers' beam search (``GenerationMixin._beam_search``) costs a Python loop of ~100 small launches, a cache
reorder over every layer and a forward per new token. Here the whole step runs in one graph: the cache reorder
(every row takes its parent beam's keys and values, all layers at once), the decode step over the
``batch * num_beams`` rows, log-softmax, the min-length EOS ban and transformers' beam bookkeeping (top-k of the
continuations, the running beams, the finished hypotheses with their length penalty, the early-stop heuristic),
with transformers' arithmetic op for op (its helpers take the step number as a Python int, so they cannot be
captured: :meth:`_Program.score` is their device-counter twin). The host looks at the stop flag only every
``STOP_CHECK_EVERY`` steps; steps that run after the search has stopped leave its state unchanged.

The settings it serves (``refusal``): greedy beam search (no sampling, groups or constraints), ``length_penalty``,
``early_stopping`` True / False / "never", ``num_return_sequences`` <= ``num_beams``, EOS ids,
``max_new_tokens`` / ``max_length``, ``min_new_tokens`` / ``min_length``, token ids returned (no
``return_dict_in_generate``). Everything else keeps transformers' loop (the middle path, ``hf_cache.py``).

The prompt is prefilled for every beam row (as transformers does, so the logits are those of the middle path bit
for bit). The KV cache is one tensor (layers, k/v, rows, heads, capacity, head dim), each layer's keys and values
views of it, so that the reorder of the generated slots of every layer is one launch on CUDA (``ops.kv_reorder``:
only the slots written so far, only the rows whose parent is another row) and one gather and one scatter of every
generated slot elsewhere. On the CPU (and with ``RuntimeConfig(cuda_graphs=False)``) the same step runs eagerly.
"""
from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch

from fuseinfer.core import decode_plan
from fuseinfer.core.decode_plan import tp_info
from fuseinfer.core.state import patch_state, runtime_config
from fuseinfer.ops.kv_reorder import available as kv_reorder_available, kv_reorder
from fuseinfer.runtime.cache import COUNTS, StaticKVCache, refuse_fp8
from fuseinfer.runtime.decode import (
    CAPACITY_ROUND, STOP_CHECK_EVERY, _graphs_enabled, capture_graphs, sessions_of, trim_sessions,
)

KEY = "beam"  # sessions[(KEY, rows)] -> BeamSession
PROGRAMS_PER_SESSION = 4  # settings kept per session (each: its state buffers and graphs)
ENABLED = True  # False: beam search takes the middle path (benchmarks compare the two)
REORDER_KERNEL = True  # False: the cache reorder gathers and scatters every generated slot on CUDA too (benchmarks)
# generation settings this path serves, besides those that do not change a greedy beam search (see refusal)
SETTINGS = {"num_beams", "early_stopping", "length_penalty", "num_return_sequences", "max_new_tokens", "max_length",
            "eos_token_id", "pad_token_id", "min_new_tokens", "min_length", "do_sample", "use_cache",
            "num_beam_groups", "diversity_penalty"}
# sampling parameters, which greedy beam search ignores (transformers adds its warpers only when sampling)
IGNORED_WITHOUT_SAMPLING = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                            "top_h"}
KWARGS = {"input_ids", "attention_mask"}
NEG = -1.0e9  # transformers' "very large negative" score


@dataclass(frozen=True)
class BeamSettings:
    """What a beam-search program bakes in besides the sizes of its session."""

    batch: int
    beams: int
    max_new: int  # N: new tokens at most (the stop at max_length)
    eos: tuple[int, ...]
    length_penalty: float
    early_stopping: bool | str
    min_new: int  # the EOS ban lasts while fewer new tokens than this were made
    fill: int  # the value of unset sequence slots (transformers' output_fill_value)
    returns: int  # num_return_sequences


def refusal(get, wants: set, kwargs: dict, model) -> str | None:
    """Why this call's beam search cannot run here (then the middle path serves it), or None.
    get: the resolved setting (hf_generate's resolver); wants: the settings that differ from the defaults."""
    if not ENABLED:
        return "the one-graph beam search is switched off"
    beams = get("num_beams") or 1
    if beams < 2:
        return "not a beam search"
    if get("do_sample"):
        return "beam sampling"
    if (get("num_beam_groups") or 1) > 1 or get("diversity_penalty"):
        return "diverse (group) beam search"
    if get("return_dict_in_generate"):
        return "return_dict_in_generate (the one-graph beam search returns token ids)"
    extra = sorted(set(kwargs) - KWARGS - SETTINGS - IGNORED_WITHOUT_SAMPLING)
    others = sorted(wants - SETTINGS - IGNORED_WITHOUT_SAMPLING - {"bos_token_id", "decoder_start_token_id",
                                                                  "transformers_version", "_from_model_config",
                                                                  "return_dict_in_generate", "output_scores",
                                                                  "output_logits", "output_attentions",
                                                                  "output_hidden_states"} - set(kwargs))
    if extra or others:
        return f"beam search with {extra + others}"
    if get("early_stopping") not in (True, False, "never"):
        return f"early_stopping={get('early_stopping')!r}"
    returns = get("num_return_sequences") or 1
    if not 1 <= returns <= beams:
        return f"num_return_sequences={returns} with num_beams={beams}"
    state = patch_state(model)
    plan = decode_plan.plan(model, state.family.decoder_layers(model))
    if plan.devices is not None or tp_info(model) is not None:
        return "a model split over devices or tensor-parallel"
    return None


def settings_for(get, input_ids: torch.Tensor, max_new: int, eos: torch.Tensor) -> BeamSettings:
    """The call's BeamSettings, with transformers' rules for the values it derives (min length, fill value)."""
    eos_ids = tuple(int(t) for t in eos.tolist())
    p = input_ids.shape[1]
    min_new = 0
    if eos_ids:  # (without EOS transformers adds no min-length processor)
        if get("min_new_tokens"):  # (it also becomes min_length = P + min_new_tokens: the same ban)
            min_new = int(get("min_new_tokens"))
        elif get("min_length"):
            min_new = max(0, int(get("min_length")) - p)
    pad = get("pad_token_id")
    if pad is None and eos_ids:
        pad = eos_ids[0]  # (generate's own default, with its warning)
    # transformers: `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1` (a pad id 0 is falsy)
    fill = (pad if pad else eos_ids[0]) if eos_ids else -1
    return BeamSettings(input_ids.shape[0], int(get("num_beams")), max_new, eos_ids, get("length_penalty"),
                        get("early_stopping"), min_new, int(fill), int(get("num_return_sequences") or 1))


class BeamSession:
    """Static cache (one tensor for every layer), step buffers and the decode step for ``rows`` beam rows; the
    programs (state and graphs) of up to PROGRAMS_PER_SESSION settings."""

    def __deepcopy__(self, memo):  # like decode._Session: copies and pickles of the model start without it
        return None

    def __reduce__(self):
        return type(None), ()

    def __init__(self, model, forward, rows: int, capacity: int, weights: tuple):
        refuse_fp8(model, "beam search")
        cfg, p = model.config, next(model.parameters())
        family = patch_state(model).family
        kv_heads, head_dim = family.kv_layout(cfg)
        layers = cfg.num_hidden_layers
        self.model, self.forward, self.rows, self.capacity = weakref.proxy(model), forward, rows, capacity
        self.weights = weights  # see decode.session_for
        dev = self.device = p.device
        plan = decode_plan.plan(model, family.decoder_layers(model))
        # (L, 2, R, H, T, D): layer l's keys and values are kv[l, 0] and kv[l, 1], each contiguous (R, H, T, D)
        self.kv = torch.zeros(layers, 2, rows, kv_heads, capacity, head_dim, dtype=p.dtype, device=dev)
        self.cache = StaticKVCache(0, rows, kv_heads, head_dim, capacity, p.dtype, dev)
        self.cache.keys = [self.kv[i, 0] for i in range(layers)]
        self.cache.values = [self.kv[i, 1] for i in range(layers)]
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # (R, 1) the step's input
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # (R, 1) its position
        self.q_start = torch.zeros(rows, dtype=torch.int32, device=dev)  # (R,) its cache slot
        self.decode_idx = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) the same slot
        self.real = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # (R, 1) real prompt tokens per row
        self.prompt = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) P: slot of the first new token
        self.step_kernel, _ = (None, None) if plan.no_kernel else family.decode_step_kernel(model, self.cache)
        self.capture_mode = plan.capture_mode
        self.graphs_on = _graphs_enabled(dev, plan, runtime_config(model))
        self.graph_steps = runtime_config(model).graph_steps
        self.programs: collections.OrderedDict[BeamSettings, _Program] = collections.OrderedDict()

    def decode(self) -> torch.Tensor:
        """The decode step over the cache at ``decode_idx`` -> fp32 logits (R, V)."""
        if self.step_kernel is not None:
            return self.step_kernel(self.tokens, self.positions, self.q_start)
        self.cache.write_idx = self.decode_idx
        return self.forward(self.model, self.tokens, self.positions, self.cache, self.q_start)

    def program(self, settings: BeamSettings) -> _Program:
        prog = self.programs.get(settings)
        if prog is None:
            while len(self.programs) >= PROGRAMS_PER_SESSION:
                self.programs.popitem(last=False)
            prog = self.programs[settings] = _Program(self, settings)
        self.programs.move_to_end(settings)
        return prog

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, beams: int) -> torch.Tensor:
        """Every prompt row for each of its beams (R = B * beams rows, as transformers expands them) into slots
        [0, P) -> the last position's fp32 logits (R, V)."""
        ids = input_ids.repeat_interleave(beams, 0)  # (R, P)
        mask = mask.to(self.device).repeat_interleave(beams, 0).long()  # (R, P)
        p = ids.shape[1]
        key_mask = self.cache.key_mask
        key_mask[:, :p].copy_(mask.bool())
        key_mask[:, p:] = True  # generated slots; the causal bound hides those not written yet
        pos = mask.cumsum(1) * mask - 1  # (R, P), -1 on padding
        self.real.copy_(mask.sum(1, keepdim=True))
        self.prompt.fill_(p)
        self.cache.write_idx = torch.arange(p, device=self.device)
        q_start = torch.zeros(self.rows, dtype=torch.int32, device=self.device)
        return self.forward(self.model, ids, pos, self.cache, q_start, keep=1)[:, -1]  # (R, V)

    def run(self, input_ids: torch.Tensor, mask: torch.Tensor, settings: BeamSettings) -> torch.Tensor:
        """Beam search -> transformers' returned sequences (B * num_return_sequences, P + n)."""
        prog = self.program(settings)
        if self.graphs_on and prog.graphs is None and settings.max_new > 1:
            prog.capture()
        prog.begin(self.prefill(input_ids.to(self.device), mask, settings.beams))
        n, i, unchecked = settings.max_new, 1, 0  # steps scored, steps since the last stop check
        group = max(prog.graphs, default=1) if prog.graphs else 1
        while i < n:
            if unchecked >= STOP_CHECK_EVERY:
                unchecked = 0
                if bool(prog.done):
                    break
            k = group if n - i >= group else 1
            prog.advance(k)
            i, unchecked = i + k, unchecked + k
        return prog.result(input_ids)


class _Program:
    """The beam-search state of one setting over a session's cache and buffers, and its graphs. State names follow
    transformers' ``_beam_search`` (B prompts, nb beams, K = max(2, 1 + #EOS) * nb candidates, N new tokens); the
    sequences hold the new tokens only (the prompt part is the same for every beam of a prompt)."""

    def __init__(self, session: BeamSession, s: BeamSettings):
        self.session, self.settings = weakref.proxy(session), s
        dev = session.device
        b, nb, n = s.batch, s.beams, s.max_new
        self.k = max(2, 1 + len(s.eos)) * nb
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) the step being scored (cur_len - P)
        self.run_seq = torch.full((b, nb, n), s.fill, dtype=torch.long, device=dev)  # running_sequences
        self.run_scores = torch.zeros(b, nb, device=dev)  # running_beam_scores
        self.run_bidx = torch.full((b, nb, n), -1, dtype=torch.int32, device=dev)  # running_beam_indices
        self.seqs = self.run_seq.clone()  # sequences (finished hypotheses)
        self.scores = torch.full((b, nb), NEG, device=dev)  # beam_scores
        self.bidx = self.run_bidx.clone()  # beam_indices
        self.finished = torch.zeros(b, nb, dtype=torch.bool, device=dev)  # is_sent_finished
        self.improvable = torch.ones(b, 1, dtype=torch.bool, device=dev)  # is_early_stop_heuristic_unsatisfied
        self.done = torch.zeros(1, dtype=torch.bool, device=dev)  # not _beam_search_has_unfinished_sequences
        self.top_mask = torch.cat([torch.ones(nb, dtype=torch.bool), torch.zeros(self.k - nb, dtype=torch.bool)]
                                  ).to(dev)  # top_num_beam_mask
        self.eos = torch.tensor(s.eos, dtype=torch.long, device=dev)
        self.neg = torch.tensor(NEG, dtype=torch.float32, device=dev)  # () NEG as a float32 operand
        vocab = session.model.get_output_embeddings().weight.shape[0]
        self.eos_mask = torch.isin(torch.arange(vocab, device=dev), self.eos)  # (V,) as the min-length processors
        self.batch_offset = torch.arange(b, device=dev).view(-1, 1) * nb  # (B, 1)
        self.rows = torch.arange(b * nb, device=dev)  # (R,)
        self.slots = torch.arange(n, device=dev)  # (N,) cache slots of the new tokens: P + j (set by begin)
        # length penalties (cur_len + 1 - P) ** lp of the step being scored, and the heuristic's best length, as
        # transformers computes them (Python floats); on CUDA a tensor divided by a Python float is multiplied by
        # its float32 reciprocal (PyTorch's div_true kernel), on the CPU divided by it in float32
        lp = s.length_penalty
        finals = [(j + 1) ** lp for j in range(n)]
        best = [(n ** lp) if (s.early_stopping == "never" and lp > 0.0) else (j + 1) ** lp for j in range(n)]
        self.by_reciprocal = dev.type == "cuda"
        self.pen = self._table(finals).to(dev)  # (N,)
        self.best_pen = self._table(best).to(dev)  # (N,)
        # on CUDA one kernel copies only the slots written so far and only for the rows that change parent
        self.reorder_kernel = REORDER_KERNEL and dev.type == "cuda" and kv_reorder_available(dev)
        COUNTS["beam_reorder_kernel" if self.reorder_kernel else "beam_reorder_gather"] += 1
        self.graphs = None

    def _table(self, values: list) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float32)
        return 1.0 / t if self.by_reciprocal else t

    def _div(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """x / table[step] with transformers' rounding (see __init__)."""
        d = table.index_select(0, self.step)  # (1,)
        return x * d if self.by_reciprocal else x / d

    def begin(self, logits: torch.Tensor) -> None:
        """Reset the state for a call whose prompt the session just prefilled, and score its logits (R, V)."""
        ses = self.session
        self.run_seq.fill_(self.settings.fill)
        self.run_scores.zero_()
        self.run_scores[:, 1:] = NEG
        self.run_bidx.fill_(-1)
        self.seqs.fill_(self.settings.fill)
        self.scores.fill_(NEG)
        self.bidx.fill_(-1)
        self.finished.zero_()
        self.improvable.fill_(True)
        self.done.zero_()
        self.step.zero_()
        if not self.reorder_kernel:  # (the slots the gather / scatter reorder moves)
            torch.add(ses.prompt, torch.arange(self.settings.max_new, device=ses.device), out=self.slots)
        self.score(logits)

    def score(self, logits: torch.Tensor) -> None:
        """One iteration of transformers' beam-search loop after the forward, for logits (R, V) fp32 of step
        ``self.step``: the state is updated in place, unless the search had already stopped."""
        s = self.settings
        b, nb, n, step = s.batch, s.beams, s.max_new, self.step
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)  # (R, V)
        if s.min_new:  # MinLength / MinNewTokensLength processors: no EOS before min_new new tokens
            log_probs = torch.where(self.eos_mask & (step < s.min_new), -float("inf"), log_probs)
        vocab = log_probs.shape[-1]
        log_probs = log_probs.view(b, nb, vocab) + self.run_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (b, -1))  # (B, nb * V)
        # _get_top_k_continuations
        topk_log_probs, topk_indices = torch.topk(log_probs, k=self.k)  # (B, K)
        topk_current_beam_indices = topk_indices // vocab
        topk_running_beam_indices = _gather(self.run_bidx, topk_current_beam_indices)  # (B, K, N)
        topk_running_sequences = _gather(self.run_seq, topk_current_beam_indices)  # (B, K, N)
        topk_ids = topk_indices % vocab
        topk_running_sequences.index_copy_(2, step, topk_ids[:, :, None])
        batch_modified_indices = topk_current_beam_indices + self.batch_offset
        topk_running_beam_indices.index_copy_(2, step, batch_modified_indices[:, :, None].to(torch.int32))
        # stopping criteria: EOS (EosTokenCriteria) or max length (MaxLengthCriteria: cur_len + 1 >= max_length)
        # (isin's own kernel may sort and sync, which a graph cannot hold: the same test as a comparison)
        # (one EOS id: one comparison; step + 1 >= n as step >= n - 1: the same booleans, one launch fewer each)
        eos_hit = topk_ids == self.eos if len(s.eos) == 1 else (topk_ids[:, :, None] == self.eos).any(-1)
        hits = eos_hit | (step >= n - 1)  # (B, K)
        # _get_running_beams_for_next_iteration
        # (bool * a float32 0-dim tensor: the float32 product of .to(float32) * NEG, without the conversion's launch)
        topk_running_log_probs = topk_log_probs + hits * self.neg
        next_topk_indices = torch.topk(topk_running_log_probs, k=nb)[1]
        run_seq = _gather(topk_running_sequences, next_topk_indices)
        run_scores = _gather(topk_running_log_probs, next_topk_indices)
        run_bidx = _gather(topk_running_beam_indices, next_topk_indices)
        # _update_finished_beams
        did_top_num_beams_just_finished = hits & self.top_mask[None, :]
        topk_log_probs = self._div(topk_log_probs, self.pen)
        beams_in_batch_are_full = torch.all(self.finished, axis=-1, keepdims=True) & (s.early_stopping is True)
        topk_log_probs += beams_in_batch_are_full * self.neg
        topk_log_probs += (~self.improvable) * self.neg
        topk_log_probs += (~did_top_num_beams_just_finished) * NEG
        merged_sequences = torch.cat((self.seqs, topk_running_sequences), dim=1)
        merged_scores = torch.cat((self.scores, topk_log_probs), dim=1)
        merged_beam_indices = torch.cat((self.bidx, topk_running_beam_indices), dim=1)
        merged_is_sent_finished = torch.cat((self.finished, did_top_num_beams_just_finished), dim=1)
        topk_merged_indices = torch.topk(merged_scores, k=nb)[1]
        seqs = _gather(merged_sequences, topk_merged_indices)
        scores = _gather(merged_scores, topk_merged_indices)
        bidx = _gather(merged_beam_indices, topk_merged_indices)
        finished = _gather(merged_is_sent_finished, topk_merged_indices)
        # _check_early_stop_heuristic (cur_len + 1)
        best_possible_running_score = self._div(run_scores[:, :1], self.best_pen)
        worst_finished_score = torch.where(finished, torch.min(scores, dim=1, keepdim=True)[0], NEG)
        improvable = self.improvable & torch.any(best_possible_running_score > worst_finished_score, dim=-1,
                                                 keepdim=True)
        # _beam_search_has_unfinished_sequences
        go_on = torch.any(improvable) & ~(torch.all(finished) & (s.early_stopping is True)) & ~torch.all(hits)
        stopped = self.done  # (1,) the search had stopped before this step: keep its state
        for old, new in ((self.run_seq, run_seq), (self.run_scores, run_scores), (self.run_bidx, run_bidx),
                         (self.seqs, seqs), (self.scores, scores), (self.bidx, bidx), (self.finished, finished),
                         (self.improvable, improvable)):
            torch.where(stopped, old, new, out=old)
        self.done.copy_(stopped | ~go_on)

    def decode_step(self) -> None:
        """One step: rows take their parent beam's cache, the running beams' new tokens go through the model, the
        logits are scored (everything here is captured in the graph)."""
        ses, s = self.session, self.settings
        # (R,) beam_idx of reorder_cache; after the search stopped (its state kept, the steps until the host looks
        # are idle) every row its own parent and token 0, as the unset slots hold -1
        stopped = self.done
        parent = torch.where(stopped, self.rows, self.run_bidx.index_select(2, self.step).reshape(-1).long())
        if self.reorder_kernel:  # the slots written so far, [P, P + step), of the rows whose parent is another row
            kv_reorder(ses.kv, parent, ses.prompt, self.step, s.max_new)
        else:  # the new tokens' slots of every layer, rows taken from their parents: one gather, one scatter
            region = ses.kv[:, :, parent[:, None], :, self.slots[None, :]]  # (R, N, L, 2, H, D)
            ses.kv[:, :, self.rows[:, None], :, self.slots[None, :]] = region
        ses.tokens.copy_(torch.where(stopped, 0, self.run_seq.index_select(2, self.step).reshape(-1, 1)))  # (R, 1)
        slot = ses.prompt + self.step  # (1,)
        ses.positions.copy_(ses.real + self.step)
        ses.q_start.copy_(slot.to(torch.int32).expand(ses.rows))
        ses.decode_idx.copy_(slot)
        logits = ses.decode()
        self.step.add_(1)
        self.score(logits)

    def capture(self) -> None:
        """Graphs of one step and (graph_steps > 1) of several in a row. The warm-up steps run on a valid state:
        a step scored on zero logits (the call's begin rewrites the state and the cache)."""
        ses = self.session
        COUNTS["beam_graphs"] += 1
        ses.prompt.zero_()
        ses.real.zero_()
        ses.cache.key_mask.fill_(True)  # (no query of the warm-up without a key; the prefill rewrites the mask)
        self.begin(torch.zeros(ses.rows, self.eos_mask.shape[0], device=ses.device))
        steps = min(ses.graph_steps, self.settings.max_new - 1)
        self.graphs = capture_graphs(self.decode_step, sorted({1, steps}), self.step, ses.capture_mode)

    def advance(self, steps: int) -> None:
        if self.graphs:
            self.graphs[steps].replay()
        else:
            for _ in range(steps):
                self.decode_step()

    def result(self, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers' output: the best num_return_sequences finished hypotheses per prompt, cut to the longest."""
        s = self.settings
        seqs = self.seqs[:, :s.returns].reshape(-1, s.max_new)  # (B * nrs, N)
        bidx = self.bidx[:, :s.returns].reshape(-1, s.max_new)
        n = int(((bidx + 1).bool()).sum(dim=1).max())
        prompt = input_ids.repeat_interleave(s.returns, 0)
        return torch.cat([prompt, seqs[:, :n].to(input_ids.device)], dim=1)


def _gather(tensor: torch.Tensor, beam_indices: torch.Tensor) -> torch.Tensor:
    """transformers' ``_gather_beams``: tensor (B, beams, ...) at beam_indices (B, k) along dim 1."""
    while len(beam_indices.shape) < len(tensor.shape):
        beam_indices = beam_indices.unsqueeze(-1)
    return torch.take_along_dim(input=tensor, indices=beam_indices, dim=1)


def session_for(model, forward, rows: int, max_length: int) -> BeamSession:
    """The model's BeamSession for ``rows`` rows with room for ``max_length`` tokens (made anew when it has not)."""
    sessions, weights = sessions_of(model)  # (dropped if the model's tensors moved)
    capacity = min(model.config.max_position_embeddings, -(-max_length // CAPACITY_ROUND) * CAPACITY_ROUND)
    session = sessions.get((KEY, rows))
    if session is None or session.capacity < capacity:
        sessions.pop((KEY, rows), None)
        del session
        COUNTS["cache"] += 1
        session = sessions[(KEY, rows)] = BeamSession(model, forward, rows, capacity, weights)
    sessions.touch((KEY, rows))
    return session


@torch.no_grad()
def beam_generate(model, forward, input_ids: torch.Tensor, mask: torch.Tensor, settings: BeamSettings):
    """Run a checked beam search (the caller holds ``model_lock(model)``) -> token ids like transformers'."""
    dev = next(model.parameters()).device
    rows = settings.batch * settings.beams
    COUNTS["beam"] += 1
    with torch.cuda.device(dev) if dev.type == "cuda" else _null():
        session = session_for(model, forward, rows, input_ids.shape[1] + settings.max_new)
        out = session.run(input_ids, mask, settings)
        if dev.type == "cuda":  # (the result is copied out of the session's buffers before the next caller runs)
            torch.cuda.current_stream(dev).synchronize()
        del session
        trim_sessions(model)  # the cache budget, as after the other paths' calls
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()
