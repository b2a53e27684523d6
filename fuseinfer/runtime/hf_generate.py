"""``model.generate`` for patched models: takes the fast decode path when the call is one it supports
(greedy or sampling with temperature / top-k / top-p, batch >= 1 with left padding, within the model's
positions), and otherwise hands the call to transformers unchanged, logging why once per reason."""
from __future__ import annotations

import logging
import re
import weakref
from typing import TYPE_CHECKING

import torch

from ..errors import FuseInferError
from .decode import decode_forward, generate

if TYPE_CHECKING:  # transformers is imported when the hook runs, so that ``import fuseinfer`` does not load it
    from transformers import GenerationConfig

logger = logging.getLogger("fuseinfer")
_HANDLED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
            "pad_token_id"}
_HARMLESS = {"bos_token_id", "decoder_start_token_id", "use_cache", "transformers_version", "_from_model_config",
             "output_attentions", "output_hidden_states"}
_KWARGS = _HANDLED | {"input_ids", "attention_mask", "use_cache"}
_logged: set[str] = set()


def _fast_path_reason(model, input_ids, kwargs, cfg: GenerationConfig) -> str | None:
    """None when the call can take the fast path, else why not."""
    extra = sorted(set(kwargs) - _KWARGS)
    if extra:
        return f"unsupported generate() arguments {extra}"
    unsupported = sorted(set(cfg.to_diff_dict()) - _HANDLED - _HARMLESS)
    if unsupported:
        return f"generation config sets {unsupported}"
    if kwargs.get("use_cache", cfg.use_cache) is False:
        return "use_cache=False"
    if model.training:
        return "model is in training mode"
    why = decode_forward(model)[1]
    if why is not None:
        return why
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "input_ids must be a (batch, length) tensor"
    if input_ids.device != next(model.parameters()).device:
        return "input_ids are on another device than the model"
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask[:, -1].all()):
        return "right padding (use tokenizer.padding_side = 'left')"
    return None


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
    cfg = generation_config if generation_config is not None else model.generation_config
    reason = _fast_path_reason(model, input_ids, kwargs, cfg)
    if reason is None:
        from transformers import GenerationConfig

        get = lambda name: kwargs[name] if name in kwargs else getattr(cfg, name, None)  # noqa: E731
        defaults = GenerationConfig._get_default_generation_params()
        opt = lambda name: defaults[name] if get(name) is None else get(name)  # noqa: E731
        max_new = get("max_new_tokens")
        if max_new is None:
            max_new = opt("max_length") - input_ids.shape[1]
        if max_new < 1 or input_ids.shape[1] + max_new > model.config.max_position_embeddings:
            reason = f"{max_new} new tokens after a prompt of {input_ids.shape[1]} do not fit the model's positions"
    if reason is not None:
        key = re.sub(r"\d+", "N", reason)  # once per kind of reason, whatever its numbers
        if key not in _logged:
            _logged.add(key)
            logger.warning("fuseinfer: model.generate falls back to transformers: %s", reason)
        return type(model).generate(model, inputs, generation_config=generation_config, **kwargs)
    eos = get("eos_token_id")
    pad = get("pad_token_id")
    return generate(model, input_ids, kwargs.get("attention_mask"), max_new_tokens=max_new,
                    do_sample=bool(opt("do_sample")), temperature=opt("temperature"), top_k=opt("top_k"),
                    top_p=opt("top_p"), eos_token_id=eos, pad_token_id=pad)
