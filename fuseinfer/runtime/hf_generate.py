"""``model.generate`` for patched models. Three paths, in order:

1. the fast path (``fuseinfer.generate``: static cache, graph-replayed decode steps with the token choice and the
   logits processors inside the graph) when every setting of the call is one it runs (``_FAST``);
2. for greedy beam search, ``beam.py`` (the whole beam step, cache reorder and scoring included, one graph replay);
   the middle path (``hf_cache.py``) for the other settings of transformers' loop (other beam searches, assisted
   decoding, custom logits processors / stopping criteria, ...): transformers' loop, the model's forward one
   graph replay per decode step over fuseinfer's static cache;
3. transformers' generate unchanged (the model's own cache), logging the reason once per kind of reason, for what
   neither serves (e.g. ``output_attentions``, a cache passed in, right padding).

The argument checks are ``args.prepare_call``'s, shared with ``fuseinfer.generate``. A call with the arguments of
an earlier fast-path call on the same model, configs and patch (``_Plan``) skips the resolution and goes to the
prefill at once (its host time is the first token's latency on an idle GPU); the prompt's contents (padding) are
checked at every call. Calls on one model from several threads run one at a time (``decode.model_lock``).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import re
import weakref
from typing import TYPE_CHECKING

import torch

from fuseinfer.core.config import ATTN_NAME
from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.state import patch_state
from fuseinfer.runtime.args import Call, check_shapes, decode_forward, eos_tensor, in_vocabulary, pad_id, prepare_call
from fuseinfer.runtime.decode import SESSIONS_ATTR, model_lock, run_call, sessions_of, trim_sessions
from fuseinfer.runtime.probe import one_check, probe

if TYPE_CHECKING:  # transformers is imported when the hook runs, so that ``import fuseinfer`` does not load it
    from transformers import GenerationConfig

logger = logging.getLogger("fuseinfer")
# settings the fast path runs (generation config fields or keyword arguments)
_FAST = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p", "eos_token_id",
         "pad_token_id", "min_new_tokens", "min_length", "repetition_penalty", "no_repeat_ngram_size",
         "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "stop_strings", "return_dict_in_generate",
         "output_scores", "output_logits"}
_HARMLESS = {"bos_token_id", "decoder_start_token_id", "use_cache", "transformers_version", "_from_model_config",
             "output_attentions", "output_hidden_states"}
_KWARGS = _FAST | {"input_ids", "attention_mask", "use_cache", "streamer", "tokenizer"}
# what only transformers' own generate serves: outputs the fused forward does not make, a cache of the caller's
_NOT_MIDDLE = {"past_key_values", "cache_implementation", "inputs_embeds", "custom_generate", "synced_gpus",
               "output_attentions", "output_hidden_states", "cache_config", "prefill_chunk_size"}
_logged: set[str] = set()


def _reasons(model, input_ids, kwargs, configs: list, get, defaults: dict, checked: tuple) -> tuple[str | None, bool]:
    """(None, _) when the call can take the fast path, else (why not, whether the middle path can serve it).
    checked: ``decode_forward(model)``."""
    if get("use_cache") is False:
        return "use_cache=False", False
    if model.generation_config is configs[0] and _memo(model.config, "generation",
                                                        lambda: bool(model.config._get_generation_parameters())):
        return "generation settings on model.config (transformers refuses them: use model.generation_config)", False
    if model.training:
        return "model is in training mode", False
    why = checked[1]
    if why is not None:
        return why, False
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "input_ids must be a (batch, length) tensor", False
    if input_ids.device != next(model.parameters()).device:
        return "input_ids are on another device than the model", False
    wants = _wants(configs, kwargs, get, defaults)
    if get("return_dict_in_generate") and (get("output_attentions") or get("output_hidden_states")):
        return "output_attentions / output_hidden_states (the fused forward does not make them)", False
    extra = sorted(set(kwargs) - _KWARGS)
    if extra:
        return f"unsupported generate() arguments {extra}", not (set(extra) & _NOT_MIDDLE)
    unsupported = sorted(wants - _FAST - _HARMLESS - _KWARGS)
    if unsupported:
        return f"generation config sets {unsupported}", not (set(unsupported) & _NOT_MIDDLE)
    return None, True


def _wants(configs: list, kwargs, get, defaults: dict) -> set:
    """The settings the call sets to something other than transformers' defaults (keyword or either config)."""
    set_keys = set().union(*(_memo(c, "diff", lambda c=c: frozenset(c.to_diff_dict())) for c in configs))
    set_keys |= set(kwargs)
    return {k for k in set_keys if (value := get(k)) is not None and value != defaults.get(k)}


# id(obj), what -> (weak reference to obj, deep copy of its attributes then, the value computed)
_memos: dict[tuple, tuple] = {}


def _memo(obj, what: str, compute):
    """``compute()`` for ``obj`` (a generation or model config), computed again only when obj's attributes differ
    from a deep copy taken when it was last computed (configs are mutable: a caller may set a field between calls;
    comparing their attributes costs a few microseconds, ``to_diff_dict`` and the config's generation-parameter scan
    ~0.1-0.2 ms each). A value whose comparison is not a plain bool (a tensor) means no memo."""
    key = (id(obj), what)
    hit = _memos.get(key)
    if hit is not None and hit[0]() is obj:
        try:
            if obj.__dict__ == hit[1]:
                return hit[2]
        except Exception:  # noqa: BLE001 (e.g. a tensor-valued field: compute it)
            pass
    value = compute()
    try:
        snapshot = copy.deepcopy(obj.__dict__)
        if not snapshot == obj.__dict__:  # (a field without value equality: every call would miss)
            return value
        ref = weakref.ref(obj, lambda _, key=key: _memos.pop(key, None))
    except Exception:  # noqa: BLE001 (no copy, no comparison or no weak reference: no memo)
        return value
    _memos[key] = (ref, snapshot, value)
    return value


def _resolver(model, generation_config, kwargs):
    """(configs, get, defaults): get(name) is the setting as transformers' generate resolves it: the call's keyword
    argument, else the passed generation_config's value, else the model's generation_config's (None counts as unset
    in both), else transformers' global default (``defaults``)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig._get_default_generation_params()
    configs = [c for c in (generation_config, model.generation_config) if c is not None]

    def get(name: str):
        if name in kwargs:
            return kwargs[name]
        for cfg in configs:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
        return defaults.get(name)

    return configs, get, defaults


def _max_new_tokens(model, prompt_len: int, configs: list, kwargs, get) -> int:
    """New tokens as transformers' generate counts them: max_new_tokens if set; else max_length minus the prompt,
    where an unset max_length means transformers' default (20) new tokens, capped at the model's positions."""
    max_new = get("max_new_tokens")
    if max_new is not None:
        return max_new
    max_length = get("max_length")
    if kwargs.get("max_length") is None and all(getattr(c, "max_length", None) is None for c in configs):
        max_length = min(max_length + prompt_len, model.config.max_position_embeddings)
    return max_length - prompt_len


def _inferred_mask(input_ids: torch.Tensor, pad, eos: torch.Tensor) -> torch.Tensor | None:
    """transformers' mask for a call without one: input_ids != pad where the pad token occurs in the prompt and
    is not an EOS token (eos: (n_eos,) int64, ``eos_tensor``), else None (no padding)."""
    if pad is None or pad in eos.tolist() or not bool((input_ids == pad).any()):
        return None
    return input_ids.ne(pad).long()


class GenerateHook:
    """``model.generate`` of a patched model (kept in the model's ``__dict__``): ``patched_generate`` through a
    weak reference, so that the hook does not tie the model into a reference cycle that only the garbage
    collector would free (with its caches and graphs)."""

    def __init__(self, model):
        self._model = weakref.ref(model)

    def __deepcopy__(self, memo):  # a deep copy of the model gets a hook on the copy
        model = self._model()
        return GenerateHook(memo.get(id(model), model))

    def __reduce__(self):  # torch.save(model) / pickle: the loaded model gets a hook on itself
        return GenerateHook, (self._model(),)

    def __call__(self, inputs=None, generation_config: GenerationConfig | None = None, **kwargs):
        model = self._model()
        if model is None:
            raise FuseInferError("model.generate was called after its model was garbage-collected")
        return patched_generate(model, inputs, generation_config, **kwargs)


def patched_generate(model, inputs=None, generation_config: GenerationConfig | None = None, **kwargs):
    """Drop-in ``generate`` installed by ``fuseinfer.patch`` on models that have one."""
    with model_lock(model), one_check(model):  # the sessions, and the attention setting the fallback switches,
        return _generate(model, inputs, generation_config, kwargs)  # are per model; it is checked once (probe.py)


# ---- the resolved fast-path calls, by their arguments ----

PLANS_PER_MODEL = 8  # argument sets whose resolved call a model keeps (least recently used dropped first)
_PLAIN = (int, float, bool, str, type(None))


def _plain(value):
    """``value`` as part of a hashable key when it is plain data (numbers, strings, None, lists and tuples of them;
    not a tensor, whose contents may change in place); else TypeError."""
    kind = type(value)  # (in the key: 1, 1.0 and True are equal keys, and not the same argument)
    if kind in _PLAIN:
        return kind, value
    if kind is list or kind is tuple:
        return kind, tuple(map(_plain, value))
    raise TypeError(kind.__name__)


def _plan_key(model, inputs, generation_config, kwargs) -> tuple | None:
    """What a call's fast-path resolution depends on besides the model's state and configs, whose objects
    ``_Plan.holds`` checks: the keyword arguments (plain values only: none with a streamer, a tokenizer or a
    tensor argument), how the prompt was passed, its shape, dtype and device and the mask's (its contents are
    checked at every call), the training flag; None: not kept."""
    ids = kwargs.get("input_ids", inputs)
    mask = kwargs.get("attention_mask")
    if type(ids) is not torch.Tensor or (mask is not None and type(mask) is not torch.Tensor):
        return None
    try:
        args = tuple(sorted((k, _plain(v)) for k, v in kwargs.items() if k != "input_ids" and k != "attention_mask"))
    except TypeError:
        return None
    return (args, inputs is None, "input_ids" in kwargs, id(generation_config), ids.shape, ids.dtype, ids.device,
            None if mask is None else (mask.shape, mask.dtype, mask.device), model.training)


class _Plan:
    """A call resolved to the fast path (``prepare_call``'s Call without its mask), valid while the model's patch
    state, its probe (tree, tensors, placement) and the configs the resolution read are the same objects with the
    same attributes (compared with deep copies taken when it was resolved: configs are mutable)."""

    __slots__ = ("call", "pad", "device", "state", "probe", "configs")

    def __init__(self, model, generation_config, call: Call, pad):
        self.call = dataclasses.replace(call, mask=None, extra={})
        self.pad = pad  # the pad_token_id setting (None: unset), as the mask is inferred from it
        self.device = next(model.parameters()).device  # (the probe sees a move)
        self.state, self.probe = patch_state(model), probe(model)
        objs = (model.config, model.generation_config) + ((generation_config,) if generation_config is not None
                                                          else ())
        self.configs = tuple((obj, copy.deepcopy(obj.__dict__)) for obj in objs)
        if not all(snapshot == obj.__dict__ for obj, snapshot in self.configs):  # (no value equality: no plan)
            raise TypeError("a config without value equality")

    def holds(self, model, generation_config) -> bool:
        """Whether the call resolves as it did (checks the model's probe: the caller holds model_lock)."""
        configs = self.configs
        if (patch_state(model) is not self.state or configs[0][0] is not model.config
                or configs[1][0] is not model.generation_config
                or (generation_config is not None and configs[2][0] is not generation_config)
                or probe(model) is not self.probe):
            return False
        try:
            return all(obj.__dict__ == snapshot for obj, snapshot in configs)
        except Exception:  # noqa: BLE001 (a field that cannot be compared: resolve anew)
            return False


def _planned(model, key, generation_config) -> _Plan | None:
    sessions = model.__dict__.get(SESSIONS_ATTR)
    plans = getattr(sessions, "plans", None)
    plan = plans.get(key) if plans else None
    if plan is None or not plan.holds(model, generation_config):
        return None
    plans.move_to_end(key)
    return plan


def _remember(model, key, generation_config, call: Call, pad) -> None:
    try:
        plan = _Plan(model, generation_config, call, pad)
    except Exception:  # noqa: BLE001 (a config that cannot be copied or compared: no plan)
        return
    plans = sessions_of(model)[0].plans
    plans[key] = plan
    plans.move_to_end(key)
    while len(plans) > PLANS_PER_MODEL:
        plans.popitem(last=False)


def _generate(model, inputs, generation_config, kwargs):
    input_ids = kwargs.get("input_ids", inputs)
    # a call with the arguments, configs and model state of an earlier fast-path call: its resolution again (the
    # host time before the prefill is the first token's latency); the prompt's contents are checked as ever
    key = _plan_key(model, inputs, generation_config, kwargs)
    plan = _planned(model, key, generation_config) if key is not None else None
    if plan is not None:
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = _inferred_mask(input_ids, plan.pad, plan.call.eos)
        if mask is None or check_shapes(model, input_ids, mask, plan.call.max_new) is None:
            return run_call(model, input_ids, dataclasses.replace(plan.call, mask=mask, extra={}), plan.device)
    configs, get, defaults = _resolver(model, generation_config, kwargs)
    checked = decode_forward(model)  # (once per call: it walks the model's modules)
    reason, middle = _reasons(model, input_ids, kwargs, configs, get, defaults, checked)
    if reason is None and inputs is not None and "input_ids" in kwargs:
        reason, middle = "both inputs and input_ids given", False  # (transformers refuses the call)
    max_new, mask, pad, eos = None, None, get("pad_token_id"), eos_tensor(get("eos_token_id"))
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and (reason is None or middle):
        max_new = _max_new_tokens(model, input_ids.shape[1], configs, kwargs, get)
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = _inferred_mask(input_ids, pad, eos)
    if reason is None:
        call = prepare_call(model, input_ids, mask, max_new, bool(get("do_sample")), get("temperature"),
                            get("top_k"), get("top_p"), eos, pad, min_p=get("min_p"),
                            min_new_tokens=get("min_new_tokens"), min_length=get("min_length"),
                            repetition_penalty=get("repetition_penalty"),
                            no_repeat_ngram_size=get("no_repeat_ngram_size"), bad_words_ids=get("bad_words_ids"),
                            suppress_tokens=get("suppress_tokens"),
                            begin_suppress_tokens=get("begin_suppress_tokens"), stop_strings=get("stop_strings"),
                            tokenizer=kwargs.get("tokenizer"), streamer=kwargs.get("streamer"),
                            return_dict_in_generate=bool(get("return_dict_in_generate")),
                            output_scores=bool(get("output_scores")), output_logits=bool(get("output_logits")),
                            checked_forward=checked[0])
        if isinstance(call, Call):
            if call.max_new < 1:  # (transformers' own checks for a call that makes no token)
                return _transformers_generate(model, inputs, generation_config, kwargs)
            if key is not None:
                _remember(model, key, generation_config, call, pad)
            return run_call(model, input_ids, call)
        if call.invalid:
            raise FuseInferError(call.message)
        reason, middle = call.message, False
    if middle:
        problem = check_shapes(model, input_ids, mask, max_new)
        if problem is not None and problem.invalid:  # (transformers refuses it too, less clearly)
            raise FuseInferError(problem.message)
        if problem is None and not in_vocabulary(model, pad_id(pad, eos)):
            problem = "pad token (pad_token_id, else the first EOS id) is not in the model's vocabulary"
        if problem is None and max_new < 1:
            problem = "no new tokens"
        if problem is None and (get("num_beams") or 1) > 1:
            from fuseinfer.runtime import beam

            why = beam.refusal(get, _wants(configs, kwargs, get, defaults), kwargs, model)
            if why is None:
                settings = beam.settings_for(get, input_ids, max_new, eos)
                return beam.beam_generate(model, checked[0], input_ids,
                                          torch.ones_like(input_ids) if mask is None else mask, settings)
            reason = f"{reason}; {why}"
        if problem is None:
            _log(f"model.generate takes the middle path (transformers' loop, fused static-cache forward): {reason}",
                 logging.INFO)
            return _middle_generate(model, inputs, generation_config, kwargs, input_ids.shape[1] + max_new,
                                    checked[0])
        reason = f"{reason}; {getattr(problem, 'message', problem)}"
    _log(f"model.generate falls back to transformers: {reason}")
    return _transformers_generate(model, inputs, generation_config, kwargs)


def _log(message: str, level: int = logging.WARNING) -> None:
    key = re.sub(r"\d+", "N", message)  # once per kind of reason, whatever its numbers
    if key not in _logged:
        _logged.add(key)
        logger.log(level, "fuseinfer: %s", message)


def _middle_generate(model, inputs, generation_config, kwargs, max_length: int, forward=None):
    """transformers' generate with a FusedCache and the model's forward wrapped for it (for this call only)."""
    from fuseinfer.runtime.hf_cache import FusedCache, forward_over_fused_cache

    if forward is None:  # (_generate passes the one it checked)
        forward = decode_forward(model)[0]
    had = "forward" in model.__dict__
    before = model.__dict__.get("forward")
    model.forward = forward_over_fused_cache(model)
    dev = next(model.parameters()).device
    try:
        with torch.cuda.device(dev) if dev.type == "cuda" else _null():
            # (the patched attention stays selected: every forward of the call runs fuseinfer's decode forward)
            out = _transformers_generate(model, inputs, generation_config,
                                         {**kwargs, "past_key_values": FusedCache(model, forward, max_length)},
                                         switch_attention=False)
            if isinstance(getattr(out, "past_key_values", None), FusedCache):  # transformers' type goes out
                out.past_key_values = out.past_key_values.to_dynamic()
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
            return out
    finally:
        if had:
            model.forward = before
        else:
            del model.forward
        trim_sessions(model)  # (the cache budget, as after a fast-path call)


def _null():
    import contextlib

    return contextlib.nullcontext()


def _transformers_generate(model, inputs, generation_config, kwargs, switch_attention: bool = True):
    """The fallback: the model's own generate (its instance attribute before patching, else its class's), with the
    attention implementation it had before patching for the call (transformers' generate builds its masks, e.g.
    for a static cache, through that implementation's mask function, which must return a tensor)."""
    from fuseinfer.core.state import patch_state

    state = patch_state(model)
    run = state.generate if state is not None and state.generate is not None else \
        (lambda *a, **k: type(model).generate(model, *a, **k))
    before = state.report.attn_implementation[0] if state is not None and state.report.attn_implementation else None
    if before == ATTN_NAME:  # a model built on a patched model's config: transformers' default for the call
        before = "sdpa"
    patched_impl = model.config._attn_implementation
    if before is not None and switch_attention:
        model.config._attn_implementation = before
    try:
        return run(inputs, generation_config=generation_config, **kwargs)
    finally:
        model.config._attn_implementation = patched_impl
