"""fuseinfer checkpoints in transformers' quantizer registry: ``AutoModelForCausalLM.from_pretrained(folder)`` of a
folder ``save_quantized`` / ``save_pretrained`` wrote gives the quantized, patched model (with fuseinfer imported).

``quant_method: "fuseinfer"`` resolves to ``FuseInferQuantizationConfig`` (the checkpoint's record, checked field by
field) and ``FuseInferHfQuantizer``, whose ``_process_model_before_weight_loading`` patches the meta model into the
recorded layout and checks the stored tensors (names, dtypes, shapes, content hash) exactly as ``load_quantized``
does (``quant/checkpoint.py``), so transformers loads the int8 tensors into it, uncast.

``register()`` runs on ``import fuseinfer`` without importing transformers: if transformers' quantizer registry is
not imported yet, a one-shot import hook registers the two classes when it is.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys

from fuseinfer.core.errors import FuseInferError
from fuseinfer.quant.checkpoint import QUANT_METHOD, WEIGHTS, check_record, check_tensors
from fuseinfer.quant.loading import build_layout, refresh_report

REGISTRY = "transformers.quantizers.auto"


def register() -> None:
    """Make transformers resolve ``quant_method: "fuseinfer"`` (now, or when its quantizer registry is imported)."""
    if REGISTRY in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of transformers' quantizer registry to register after it runs."""

    def find_spec(self, name, path, target=None):
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                _register()

            spec.loader.exec_module = exec_and_register
        return spec


def _register() -> None:
    from transformers.quantizers import auto

    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(_classes()[0])
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(_classes()[1])


_CLASSES: tuple = ()


def _classes() -> tuple:
    """The config and quantizer classes (defined on first use: their bases live in transformers)."""
    global _CLASSES
    if _CLASSES:
        return _CLASSES
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class FuseInferQuantizationConfig(QuantizationConfigMixin):
        """A fuseinfer checkpoint's ``quantization_config``: the record ``save_quantized`` wrote, as is."""

        def __init__(self, **record):
            self.__dict__.update(record)
            self.quant_method = QUANT_METHOD

        @classmethod
        def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
            check_record(config_dict)  # every field fuseinfer reads, by type: one FuseInferError line otherwise
            config = cls(**config_dict)
            return (config, kwargs) if return_unused_kwargs else config

        def to_dict(self) -> dict:
            return dict(self.__dict__)

    class FuseInferHfQuantizer(HfQuantizer):
        """Loads a fuseinfer checkpoint into the model patched with its recorded ops and scheme (never quantizes:
        the tensors are stored quantized)."""

        requires_calibration = True

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self.checked = check_record(quantization_config.to_dict())

        def validate_environment(self, *args, device_map=None, **kwargs):
            places = set(device_map.values()) if isinstance(device_map, dict) else set()
            spread = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate may split the model
            if len(places) > 1 or isinstance(device_map, str) and device_map in spread:
                raise FuseInferError(f"a fuseinfer quantized checkpoint loads onto one device: pass device_map="
                                     f"{{'': 'cuda'}} (or none), not {device_map!r}")

        def update_dtype(self, dtype):
            if dtype is not None and dtype != self.checked["dtype"]:
                name = str(self.checked["dtype"]).replace("torch.", "")
                cli = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[name]
                raise FuseInferError(f"this fuseinfer checkpoint is {name}, not {str(dtype).replace('torch.', '')} "
                                     f"(its int8 scales were computed for it): load it in {name} (dtype="
                                     f"torch.{name} or 'auto'; --dtype {cli} in the CLIs)")
            return self.checked["dtype"]

        def get_new_dtype(self, converter, param, dtype):
            return None  # check_tensors found every stored tensor in the model's dtype: load the bytes as stored

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            files = list(checkpoint_files or [])
            if len(files) != 1 or not str(files[0]).endswith(WEIGHTS):
                raise FuseInferError(f"a fuseinfer quantized checkpoint is one {WEIGHTS} (safetensors only); this "
                                     f"folder has {[str(f).rsplit('/', 1)[-1] for f in files]}")
            build_layout(model, self.checked)
            tied = getattr(model, "all_tied_weights_keys", None)
            if tied:  # a quantized LM head is no longer tied to the embeddings (it has no ``weight``)
                names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
                model.all_tied_weights_keys = {t: s for t, s in tied.items() if t in names and s in names}
            check_tensors(files[0], model, self.checked)
            # the guard stays unexpected for transformers' report, silently
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {
                re.escape(self.checked["guard"])}
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            refresh_report(model)
            return model.eval()

        def is_serializable(self):
            return True  # save_pretrained is fuseinfer's (quant/apply.py): the same layout

        @property
        def is_trainable(self):
            return False

    _CLASSES = (FuseInferQuantizationConfig, FuseInferHfQuantizer)
    return _CLASSES
