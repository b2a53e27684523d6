"""The one place where a generate call's arguments are checked and turned into what fast decode runs.

:func:`prepare_call` returns either a :class:`Call` or a :class:`Problem`. ``fuseinfer.generate`` raises every
problem as a ``FuseInferError``; the patched ``model.generate`` (``hf_generate.py``) raises the ``invalid`` ones
(transformers refuses those calls too) and hands the others to transformers with the problem as its one logged
reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fuseinfer.core import decode_plan
from fuseinfer.core.state import patch_state
from fuseinfer.ops.sample_tokens import sample_tokens, warp_ref
from fuseinfer.runtime.probe import probe
from fuseinfer.runtime.processors import Rule, bad_words, repetition_penalty_skips_padding


@dataclass(frozen=True)
class Problem:
    message: str
    invalid: bool = False  # a value transformers' generate refuses as well (else: a call fast decode cannot take)


@dataclass(frozen=True)
class Sampling:
    """Next-token rule: greedy, or sampling after transformers' warpers temperature, top-k, top-p, min-p (in
    that order)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed logits (B, V) fp32 -> the warped scores transformers samples from (and reports as scores)."""
        if not self.do_sample:
            return logits
        return warp_ref(logits, self.temperature, self.top_k, self.top_p, self.min_p)

    def sample(self, logits: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Processed logits (B, V) fp32 -> the sampled tokens (B,) int64 in one pass (fuseinfer::sample_tokens: the
        warpers and a Philox draw keyed by ``seed`` at counter ``offset``, both (1,) int64 device tensors), without
        materialising the warped scores."""
        return sample_tokens(logits.float(), seed, offset, self.temperature, self.top_k, self.top_p, self.min_p)

    def choose(self, warped: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Warped scores (B, V) -> scores whose first maximum per row is the next token. ``rows``: the call's real
        rows (the first ones; the rest are a batch bucket's padding, whose tokens are discarded)."""
        if not self.do_sample:
            return warped
        probs = warped.softmax(-1)
        if warped.device.type == "cpu":
            # transformers' draw, torch.multinomial over the call's rows (no CUDA graph to keep safe here): the same
            # generator calls in the same order, so torch.manual_seed gives transformers' tokens
            rows = probs.shape[0] if rows is None else rows
            chosen = torch.zeros_like(probs)  # (B, V): a one at each real row's token
            chosen[:rows].scatter_(1, torch.multinomial(probs[:rows], 1), 1.0)
            return chosen
        # Exponential race: argmax(p / E), E ~ Exp(1), samples from p and is CUDA-graph safe
        return probs / torch.empty_like(probs).exponential_()

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) fp32 -> scores (B, V) whose first maximum per row is the next token."""
        return self.choose(self.warp(logits))


@dataclass
class Call:
    """A checked call: what the session runs and what the host does around it."""

    forward: object
    mask: torch.Tensor | None  # (B, P); None: no padding (no mask to make on the device before the prefill)
    max_new: int
    sampling: Sampling
    rule: Rule
    eos: torch.Tensor  # (n_eos,) int64 on the CPU
    pad: int
    stop_strings: object = None  # transformers' StopStringCriteria, checked on the host
    streamer: object = None
    return_dict: bool = False
    extra: dict = field(default_factory=dict)


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


def decode_forward(model):
    """(the fast-decode forward of ``model``, None), or (None, why ``model`` cannot take the fast path)."""
    from fuseinfer.core.config import OPS

    state = patch_state(model)
    if state is None or set(state.config.ops) != set(OPS) or state.config.filter_fn is not None:
        return None, ("fuseinfer.generate needs a model patched with every op and no filter_fn: "
                      "call fuseinfer.patch(model) first")
    if not probe(model).hooked:  # (the probe walks the modules only when they changed: probe.py)
        return state.family.decode_forward(model)
    why = decode_plan.refusal(model)  # accelerate offload: transformers' generate runs it
    if why is not None:
        return None, why
    forward, why = state.family.decode_forward(model)
    return decode_plan.forward(model, forward, state.family.decoder_layers(model)), why


def _token_ids(value, name: str) -> tuple[int, ...] | Problem:
    if value is None:
        return ()
    try:
        ids = tuple(int(t) for t in torch.as_tensor(value).flatten().tolist())
    except (TypeError, ValueError):
        return Problem(f"{name} must be a list of token ids, got {value!r}", invalid=True)
    return ids


def check_shapes(model, input_ids, attention_mask, max_new_tokens) -> Problem | None:
    """The checks every path shares: a (B, P) tensor of integer ids, a mask of its shape, left padding, a length
    that fits."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        return Problem(f"input_ids must be (batch, length), got shape {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        return Problem(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}: pass a torch.long "
                       "tensor (as the tokenizer's return_tensors='pt' gives)", invalid=True)
    if min(input_ids.shape) == 0:
        return Problem(f"input_ids must hold at least one row of at least one token, got shape "
                       f"{tuple(input_ids.shape)}")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            return Problem(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                           f"{tuple(input_ids.shape)}")
        if not bool(attention_mask[:, -1].all()):
            return Problem("right padding: fuseinfer needs left padding (set tokenizer.padding_side = 'left')")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        return Problem(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    p, limit = input_ids.shape[1], model.config.max_position_embeddings
    if p + max_new_tokens > limit:
        return Problem(f"prompt ({p}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                       f"max_position_embeddings ({limit})")
    return None


def prepare_call(model, input_ids, attention_mask=None, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature=1.0, top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, *, min_p=None,
                 min_new_tokens=None, min_length=None, repetition_penalty=None, no_repeat_ngram_size=None,
                 bad_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None, stop_strings=None,
                 tokenizer=None, streamer=None, return_dict_in_generate=False, output_scores=False,
                 output_logits=False, checked_forward=None) -> Call | Problem:
    """Check a generate call (transformers' meaning for every argument) and describe what fast decode runs.
    ``checked_forward``: ``decode_forward(model)``'s forward where the caller has just asked for it (saves a walk
    over the model's modules)."""
    forward, why = (checked_forward, None) if checked_forward is not None else decode_forward(model)
    if forward is None:
        return Problem(why)
    problem = check_shapes(model, input_ids, attention_mask, max_new_tokens)
    if problem is not None:
        return problem
    if do_sample:
        if temperature is None or not temperature > 0:  # (written so that NaN fails too)
            return Problem(f"temperature must be > 0 when do_sample=True, got {temperature!r}", invalid=True)
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
            return Problem(f"top_k must be a non-negative integer (0 or None: no top-k), got {top_k!r}",
                           invalid=True)
        if top_p is not None and not 0 <= top_p <= 1:
            return Problem(f"top_p must be in [0, 1] (1 or None: no top-p), got {top_p!r}", invalid=True)
        if min_p is not None and not 0 <= min_p <= 1:
            return Problem(f"min_p must be in [0, 1], got {min_p!r}", invalid=True)
    if repetition_penalty is not None and not (isinstance(repetition_penalty, (int, float))
                                               and repetition_penalty > 0):
        return Problem(f"repetition_penalty must be a float > 0, got {repetition_penalty!r}", invalid=True)
    for name, value in (("min_new_tokens", min_new_tokens), ("min_length", min_length),
                        ("no_repeat_ngram_size", no_repeat_ngram_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return Problem(f"{name} must be a non-negative int, got {value!r}", invalid=True)
    if stop_strings and tokenizer is None:
        return Problem("stop_strings needs the tokenizer: pass tokenizer=... (as transformers' generate does)",
                       invalid=True)
    eos = eos_tensor(eos_token_id)
    pad = pad_id(pad_token_id, eos)
    if not in_vocabulary(model, pad):
        return Problem(f"pad_token_id {pad} is not a token of the model's vocabulary "
                       f"(0..{model.get_input_embeddings().num_embeddings - 1})")
    eos_ids = tuple(int(t) for t in eos.tolist())
    single, multi = (), ()
    if bad_words_ids is not None:
        try:
            single, multi = bad_words(bad_words_ids, eos_ids)
        except ValueError as exc:
            return Problem(str(exc), invalid=True)
        vocab = model.config.vocab_size
        if any(t >= vocab for seq in multi + tuple((s,) for s in single) for t in seq):
            return Problem(f"bad_words_ids hold token ids beyond the vocabulary ({vocab})", invalid=True)
    suppress = _token_ids(suppress_tokens, "suppress_tokens")
    begin = _token_ids(begin_suppress_tokens, "begin_suppress_tokens")
    for ids in (suppress, begin):
        if isinstance(ids, Problem):
            return ids
    penalty = float(repetition_penalty) if repetition_penalty not in (None, 1.0) else None
    rule = Rule(repetition_penalty=penalty,
                penalty_skips_padding=penalty is not None and repetition_penalty_skips_padding(),
                no_repeat_ngram_size=no_repeat_ngram_size or None, bad_single=single, bad_multi=multi,
                min_length=min_length or None, min_new_tokens=min_new_tokens or None, suppress=suppress,
                begin_suppress=begin, eos=eos_ids if (min_length or min_new_tokens) else (),
                output_scores=bool(return_dict_in_generate and output_scores),
                output_logits=bool(return_dict_in_generate and output_logits))
    sampling = Sampling(True, float(temperature), top_k or None, top_p, min_p) if do_sample else Sampling()
    criteria = None
    if stop_strings:
        from transformers.generation.stopping_criteria import StopStringCriteria

        criteria = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    return Call(forward, attention_mask, max_new_tokens, sampling, rule, eos, pad, criteria, streamer,
                bool(return_dict_in_generate))
