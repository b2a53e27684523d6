"""Logits processors of the fast decode path: transformers' processors as tensor-only code over static buffers.

Everything here runs inside the captured decode step (CUDA graph on GPU), so it reads only device tensors whose
addresses never change: the (B, capacity) token history, a (B, V + 1) "seen" mask, and the session's step
counter (the number of tokens generated so far, on the device). No host sync, no data-dependent shapes.

The order is transformers' (``GenerationMixin._get_logits_processor``): repetition penalty, no-repeat n-gram,
bad words, min length, min new tokens, suppress tokens, begin-suppress tokens; then, when sampling, the warpers
temperature, top-k, top-p, min-p (``Sampling``). A :class:`Rule` is the frozen, comparable description of one
call's processors: a session's graphs are captured for one rule and reused while calls bring the same rule.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@functools.lru_cache(maxsize=1)
def repetition_penalty_skips_padding() -> bool:
    """Whether the installed transformers leaves a row's left padding out of the repetition penalty (it passes
    ``prompt_ignore_length`` = the padding lengths since 5.2x; 5.17 penalises the pad token too)."""
    from transformers.generation.utils import GenerationMixin

    return "prompt_ignore_length" in inspect.getsource(GenerationMixin._get_logits_processor)


@dataclass(frozen=True)
class Rule:
    """The logits processors of one call (transformers' meaning for each field; None/empty: off)."""

    repetition_penalty: float | None = None
    penalty_skips_padding: bool = False  # (transformers version dependent, see repetition_penalty_skips_padding)
    no_repeat_ngram_size: int | None = None
    bad_single: tuple[int, ...] = ()  # one-token bad words (EOS ids already removed, as transformers does)
    bad_multi: tuple[tuple[int, ...], ...] = ()  # bad words of >= 2 tokens
    min_length: int | None = None  # total length (prompt + new) below which EOS is masked
    min_new_tokens: int | None = None
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    eos: tuple[int, ...] = ()  # the EOS ids the min-length rules mask
    output_scores: bool = False
    output_logits: bool = False

    @property
    def needs_history(self) -> bool:
        return bool(self.no_repeat_ngram_size) or bool(self.bad_multi)

    @property
    def needs_seen(self) -> bool:
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    @property
    def active(self) -> bool:
        return self != Rule(penalty_skips_padding=self.penalty_skips_padding, eos=self.eos,
                            output_scores=self.output_scores, output_logits=self.output_logits)


def bad_words(bad_words_ids, eos: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(single-token, multi-token) bad words as transformers' NoBadWordsLogitsProcessor takes them: validated by
    it (its ValueError), sequences that are exactly one EOS token dropped."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    proc = NoBadWordsLogitsProcessor(bad_words_ids, list(eos) if eos else None)
    seqs = [tuple(int(t) for t in s) for s in proc.sequence_bias]
    return tuple(s[0] for s in seqs if len(s) == 1), tuple(s for s in seqs if len(s) > 1)


class Processors:
    """Device state and the captured code of one :class:`Rule` for a session of ``rows`` rows and ``capacity``
    token slots (prompt + new tokens)."""

    def __init__(self, rule: Rule, rows: int, capacity: int, vocab: int, device):
        self.rule, self.vocab = rule, vocab
        self.prompt_len = torch.zeros(1, dtype=torch.long, device=device)  # (1,) P, the padded prompt length
        # (B, C) prompt + generated tokens; column decode_idx holds the current input token
        self.history = torch.zeros(rows, capacity, dtype=torch.long, device=device) if rule.needs_history else None
        self.seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device) if rule.needs_seen else None
        static = torch.zeros(vocab + 1, dtype=torch.bool, device=device)  # always-banned ids (bad words, suppress)
        ids = [t for t in rule.bad_single + rule.suppress if 0 <= t < vocab]
        if ids:
            static[torch.tensor(ids, device=device)] = True
        self.static_ban = static[:vocab] if ids else None
        self.begin_ban = self._mask(rule.begin_suppress, device)
        self.eos_mask = self._mask(rule.eos, device)
        groups: dict[int, list[tuple[int, ...]]] = {}
        for seq in rule.bad_multi:
            groups.setdefault(len(seq) - 1, []).append(seq)
        # prefix length k -> (prefixes (G, k), last tokens (G,))
        self.bad_groups = [(k, torch.tensor([s[:-1] for s in g], device=device),
                            torch.tensor([s[-1] if s[-1] < vocab else vocab for s in g], device=device))
                           for k, g in sorted(groups.items())]

    def _mask(self, ids, device) -> torch.Tensor | None:
        ids = [t for t in ids if 0 <= t < self.vocab]
        if not ids:
            return None
        mask = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        mask[torch.tensor(ids, device=device)] = True
        return mask  # (V,)

    def begin(self, ids: torch.Tensor, mask: torch.Tensor, rows: int) -> None:
        """A new call: ids, mask (b, P) left-padded prompts of the first b of ``rows`` rows (outside the graph)."""
        b, p = ids.shape
        self.prompt_len.fill_(p)
        if self.history is not None:
            self.history.zero_()
            self.history[:b, :p] = ids
        if self.seen is not None:
            self.seen.zero_()
            counted = ids
            if self.rule.penalty_skips_padding:  # positions before the first real token are left out
                first = (mask != 0).int().argmax(dim=1)  # (b,) as transformers computes the padding lengths
                counted = ids.masked_fill(torch.arange(p, device=ids.device)[None] < first[:, None], self.vocab)
            self.seen[:b].scatter_(1, counted.clamp(0, self.vocab), True)

    def record(self, tokens: torch.Tensor, slot: torch.Tensor) -> None:
        """Append the current input tokens (B, 1) (the last generated ones) at history column ``slot`` (1,)."""
        if self.history is not None:
            self.history.index_copy_(1, slot, tokens)
        if self.seen is not None:
            self.seen.scatter_(1, tokens.clamp(0, self.vocab), True)

    def __call__(self, scores: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """scores (B, V) fp32 logits -> processed scores; ``step`` (1,): tokens generated before this one, so the
        sequence length transformers' processors see is prompt_len + step."""
        r = self.rule
        length = self.prompt_len + step  # (1,)
        if self.seen is not None:  # RepetitionPenaltyLogitsProcessor
            penalised = torch.where(scores < 0, scores * r.repetition_penalty, scores / r.repetition_penalty)
            scores = torch.where(self.seen[:, :self.vocab], penalised, scores)
        if r.no_repeat_ngram_size:  # NoRepeatNGramLogitsProcessor
            scores = scores.masked_fill(self._ngram_ban(length), NEG_INF)
        if self.static_ban is not None or self.bad_groups:  # NoBadWordsLogitsProcessor (+ SuppressTokens below)
            if self.bad_groups:
                scores = scores.masked_fill(self._bad_word_ban(length), NEG_INF)
        if self.eos_mask is not None:
            below = torch.zeros(1, dtype=torch.bool, device=scores.device)
            if r.min_length:  # MinLengthLogitsProcessor
                below = below | (length < r.min_length)
            if r.min_new_tokens:  # MinNewTokensLengthLogitsProcessor
                below = below | (step < r.min_new_tokens)
            if r.min_length or r.min_new_tokens:
                scores = scores.masked_fill(self.eos_mask[None] & below[:, None], NEG_INF)
        if self.static_ban is not None:  # single-token bad words and SuppressTokensLogitsProcessor
            scores = scores.masked_fill(self.static_ban[None], NEG_INF)
        if self.begin_ban is not None:  # SuppressTokensAtBeginLogitsProcessor: the first new token only
            scores = scores.masked_fill(self.begin_ban[None] & (step == 0)[:, None], NEG_INF)
        return scores

    def _ngram_ban(self, length: torch.Tensor) -> torch.Tensor:
        """(B, V) bool: tokens that would complete an n-gram already in the row's history[:, :length]."""
        n, hist = self.rule.no_repeat_ngram_size, self.history
        rows, cap = hist.shape
        k = n - 1
        starts = torch.arange(cap - k, device=hist.device)  # window i: history[:, i:i+k], banned token i+k
        if k:
            suffix = hist.gather(1, (length - k + torch.arange(k, device=hist.device)).clamp(0, hist.shape[1] - 1)[None]
                                 .expand(rows, k))  # (B, k) the last k tokens
            match = (hist.unfold(1, k, 1)[:, :cap - k] == suffix[:, None]).all(-1)  # (B, C - k)
        else:
            match = torch.ones(rows, cap, dtype=torch.bool, device=hist.device)
        match = match & (starts + n <= length)[None]  # windows that lie wholly in the sequence
        return self._ban(torch.where(match, hist[:, k:], self.vocab))

    def _bad_word_ban(self, length: torch.Tensor) -> torch.Tensor:
        """(B, V) bool: last tokens of bad words whose other tokens end the row's history[:, :length]."""
        hist = self.history
        rows = hist.shape[0]
        idx = []
        for k, prefixes, last in self.bad_groups:
            suffix = hist.gather(1, (length - k + torch.arange(k, device=hist.device)).clamp(0, hist.shape[1] - 1)[None]
                                 .expand(rows, k))  # (B, k)
            match = (suffix[:, None] == prefixes[None]).all(-1) & (length >= k)[:, None]  # (B, G)
            idx.append(torch.where(match, last[None], self.vocab))
        return self._ban(torch.cat(idx, 1))

    def _ban(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, N) token ids, ``vocab`` for none -> (B, V) bool mask of the ids."""
        ban = torch.zeros(idx.shape[0], self.vocab + 1, dtype=torch.bool, device=idx.device)
        return ban.scatter_(1, idx, True)[:, :self.vocab]
