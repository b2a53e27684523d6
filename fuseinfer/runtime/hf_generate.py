"""``model.generate`` for patched models: takes the fast decode path when the call is one it supports
(greedy or sampling with temperature / top-k / top-p, batch >= 1 with left padding, within the model's
positions), and otherwise hands the call to transformers unchanged, logging why once per reason."""
from __future__ import annotations

import logging
import re
import weakref
from typing import TYPE_CHECKING

import torch

from ..config import ATTN_NAME
from ..errors import FuseInferError
from .decode import decode_forward, eos_tensor, generate, in_vocabulary, pad_id

if TYPE_CHECKING:  # transformers is imported when the hook runs, so that ``import fuseinfer`` does not load it
    from transformers import GenerationConfig

logger = logging.getLogger("fuseinfer")
_HANDLED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
            "pad_token_id"}
_HARMLESS = {"bos_token_id", "decoder_start_token_id", "use_cache", "transformers_version", "_from_model_config",
             "output_attentions", "output_hidden_states"}
_KWARGS = _HANDLED | {"input_ids", "attention_mask", "use_cache"}
_logged: set[str] = set()


def _fast_path_reason(model, input_ids, kwargs, configs: list, get, defaults: dict) -> str | None:
    """None when the call can take the fast path, else why not."""
    extra = sorted(set(kwargs) - _KWARGS)
    if extra:
        return f"unsupported generate() arguments {extra}"
    keys = set().union(*(c.to_diff_dict() for c in configs)) - _HANDLED - _HARMLESS
    unsupported = sorted(k for k in keys if (value := get(k)) is not None and value != defaults.get(k))
    if unsupported:
        return f"generation config sets {unsupported}"
    if get("use_cache") is False:
        return "use_cache=False"
    if model.generation_config is configs[0] and model.config._get_generation_parameters():
        return "generation settings on model.config (transformers refuses them: use model.generation_config)"
    if model.training:
        return "model is in training mode"
    why = decode_forward(model)[1]
    if why is not None:
        return why
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "input_ids must be a (batch, length) tensor"
    if input_ids.device != next(model.parameters()).device:
        return "input_ids are on another device than the model"
    return None


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
    input_ids = kwargs.get("input_ids", inputs)
    configs, get, defaults = _resolver(model, generation_config, kwargs)
    reason = _fast_path_reason(model, input_ids, kwargs, configs, get, defaults)
    if reason is None and inputs is not None and "input_ids" in kwargs:
        reason = "both inputs and input_ids given"  # (transformers refuses the call)
    if reason is None:
        max_new = _max_new_tokens(model, input_ids.shape[1], configs, kwargs, get)
        pad, eos = get("pad_token_id"), eos_tensor(get("eos_token_id"))
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = _inferred_mask(input_ids, pad, eos)
        if type(max_new) is not int or max_new < 1:
            reason = f"max_new_tokens={max_new!r} (the fast path takes a positive int)"
        elif input_ids.shape[1] + max_new > model.config.max_position_embeddings:
            reason = f"{max_new} new tokens after a prompt of {input_ids.shape[1]} do not fit the model's positions"
        elif min(input_ids.shape) == 0:
            reason = f"an empty batch or prompt, input_ids of shape {tuple(input_ids.shape)}"
        elif mask is not None and not bool(mask[:, -1].all()):
            reason = "right padding (use tokenizer.padding_side = 'left')"
        elif not in_vocabulary(model, fed_pad := pad_id(pad, eos)):
            reason = f"pad token {fed_pad} (pad_token_id, else the first EOS id) is not in the model's vocabulary"
    if reason is not None:
        key = re.sub(r"\d+", "N", reason)  # once per kind of reason, whatever its numbers
        if key not in _logged:
            _logged.add(key)
            logger.warning("fuseinfer: model.generate falls back to transformers: %s", reason)
        return _transformers_generate(model, inputs, generation_config, kwargs)
    temperature = get("temperature")
    return generate(model, input_ids, mask, max_new_tokens=max_new, do_sample=bool(get("do_sample")),
                    temperature=1.0 if temperature is None else temperature, top_k=get("top_k"), top_p=get("top_p"),
                    eos_token_id=eos, pad_token_id=pad)


def _transformers_generate(model, inputs, generation_config, kwargs):
    """The fallback: the model's own generate (its instance attribute before patching, else its class's), with the
    attention implementation it had before patching for the call (transformers' generate builds its masks, e.g.
    for a static cache, through that implementation's mask function, which must return a tensor)."""
    from ..state import patch_state

    state = patch_state(model)
    run = state.generate if state is not None and state.generate is not None else \
        (lambda *a, **k: type(model).generate(model, *a, **k))
    before = state.report.attn_implementation[0] if state is not None and state.report.attn_implementation else None
    if before == ATTN_NAME:  # a model built on a patched model's config: transformers' default for the call
        before = "sdpa"
    patched_impl = model.config._attn_implementation
    if before is not None:
        model.config._attn_implementation = before
    try:
        return run(inputs, generation_config=generation_config, **kwargs)
    finally:
        model.config._attn_implementation = patched_impl
