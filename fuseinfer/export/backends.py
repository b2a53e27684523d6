"""Backends ``ort``, ``ort-plain`` and ``tensorrt`` (registered by the eval CLI, found by the profiler).

``ort`` / ``ort-plain``: export the loaded model (fused / plain flavour) into a temporary directory, or reuse an
export under the option ``onnx_dir`` (the eval's ``--onnx-dir``; unset, ``$FUSEINFER_ONNX_DIR``) when its
manifest matches the model (config hash, weights hash over every weight, flavour, dtype; manifests are read with
the schema check of manifest.py), free the PyTorch model, and run with
:class:`~fuseinfer.export.ort_runtime.OrtDecoder` (CUDA execution provider + IO binding on GPU, CPU provider on
CPU).

Memory: ONNX Runtime allocates through its own CUDA arena, which torch's peak counters (the eval's
``peak_memory`` column) cannot see. ``details()`` adds ``device_memory``: the GPU's used memory from
``torch.cuda.mem_get_info`` (driver count), sampled when the session is created and after every prefill, decode
run and perplexity window, minus the count before the session existed (``baseline_mib``, taken after the PyTorch
model was freed). The arena keeps what it grew to, so the last sample is the peak of the run.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from fuseinfer.core import knobs
from fuseinfer.export import manifest as mf
from fuseinfer.export.errors import ExportError
from fuseinfer.harness.backends import Backend, greedy

ONNX_DIR_ENV = "FUSEINFER_ONNX_DIR"


def export_dir_for(model, flavour: str, dtype: torch.dtype, memo: dict | None = None,
                   onnx_dir: str | None = None) -> tuple[Path, bool]:
    """(directory to use, whether it is temporary): under ``onnx_dir`` (None: $FUSEINFER_ONNX_DIR), one
    sub-directory per model, flavour and dtype, reused across runs; else a fresh temporary directory. ``memo``: see
    manifest.model_hash."""
    root = onnx_dir or knobs.get(ONNX_DIR_ENV)
    if not root:
        return Path(tempfile.mkdtemp(prefix=f"fuseinfer-onnx-{flavour}-")) / "export", True
    root = Path(root).expanduser()
    memo = {} if memo is None else memo
    config = mf.config_hash(model.config)
    for found in sorted(root.glob(f"*/{mf.MANIFEST}")):  # e.g. one made by python -m fuseinfer.export --out
        try:
            m = mf.read(found.parent)
        except ExportError:
            continue
        if (m["model"]["config_hash"], m["flavour"], m["dtype"]) == (config, flavour, mf.DTYPE_NAMES[dtype]) \
                and m["model"]["weights_hash"] == mf.model_hash(model, m, memo):
            return found.parent, False
    digest = mf.model_hash(model, memo=memo).partition(":")[2][:16]
    return root / "-".join((config, digest, flavour, mf.DTYPE_NAMES[dtype])), False


class OrtBackend(Backend):
    """The model exported with onnxruntime's fused contrib ops, run by ONNX Runtime with IO binding."""

    name = "ort"
    summary = "ONNX export with onnxruntime contrib ops (SkipLayerNorm, MultiHeadAttention), IO binding"
    flavour = "fused"

    @classmethod
    def unavailable_reason(cls, device):
        from fuseinfer.export.ort_runtime import unavailable_reason

        return unavailable_reason(device)

    def prepare(self):
        from fuseinfer.export.onnx_export import to_onnx
        from fuseinfer.export.ort_runtime import OrtDecoder, device_used_mib

        memo = {}  # one pass over the weights per hash method
        directory, self._temporary = export_dir_for(self.model, self.flavour, self.dtype, memo,
                                                          self.options.onnx_dir)
        self.export_reused = (directory / mf.MANIFEST).is_file()
        if self.export_reused:
            mf.check_matches(mf.read(directory), directory, model=self.model, flavour=self.flavour,
                             dtype=self.dtype, memo=memo)
            self.export_s = None
        else:
            self.export_s = to_onnx(self.model, directory, self.flavour, source=self.source.spec,
                                    memo=memo)["export_seconds"]
        self.directory = directory
        config = self.model.config
        self.model = None  # ORT holds its own copy of the weights; the PyTorch one is freed
        _free(self.device)
        self.baseline_mib = device_used_mib(self.device)
        self.ort = OrtDecoder(directory, self.device, config=config, flavour=self.flavour, dtype=self.dtype)
        self.session_mib = self._used()
        self.peak_mib = self.session_mib

    def _used(self):
        from fuseinfer.export.ort_runtime import device_used_mib

        used = device_used_mib(self.device)
        if used is None:
            return None
        value = used - self.baseline_mib
        self.peak_mib = max(getattr(self, "peak_mib", None) or 0.0, value)
        return value

    def start(self, batch_size, max_len):
        self.ort.start(batch_size, max_len)

    def end(self):
        if getattr(self, "ort", None) is not None:
            self._used()
            self.ort.end()

    def prefill(self, input_ids):
        tokens = greedy(self.ort.prefill(input_ids))  # (B, 1)
        return tokens

    def decode_step(self, tokens):
        return greedy(self.ort.step(tokens))  # (B, 1)

    def loss(self, input_ids, labels):
        """Hugging Face's causal LM loss: logits upcast to fp32, shifted, mean over labels != -100."""
        logits = self.ort.logits(input_ids).float()  # (1, L, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        self._used()
        return loss

    def details(self):
        out = {"onnx_flavour": self.flavour, "onnx_dir": None if self._temporary else str(self.directory),
               "export_s": self.export_s, "export_reused": self.export_reused,
               "contrib_ops": self.ort.manifest["contrib_ops"] if getattr(self, "ort", None) else None}
        if self.device.type == "cuda":
            out["device_memory"] = {"method": "torch.cuda.mem_get_info: GPU used minus before the session",
                                    "baseline_mib": self.baseline_mib, "session_mib": self.session_mib,
                                    "peak_mib": self.peak_mib}
        return out

    def close(self):
        self.end()
        self.ort = None
        if getattr(self, "_temporary", False):
            shutil.rmtree(self.directory.parent, ignore_errors=True)
        super().close()


class OrtPlainBackend(OrtBackend):
    """The model exported with standard ONNX ops only, run by ONNX Runtime the same way."""

    name = "ort-plain"
    summary = "ONNX export with standard ops only (what ORT's own optimizer can do for OPT), IO binding"
    flavour = "plain"


class TensorRTBackend(Backend):
    """The plain ONNX export built into a TensorRT engine and run with execute_async_v3.

    Written against TensorRT's documented Python API; not yet run against a TensorRT install. Without
    ``tensorrt`` the eval reports the install hint in this row."""

    name = "tensorrt"
    summary = "TensorRT engine from the plain ONNX export (written against the documented API, not yet run)"

    @classmethod
    def unavailable_reason(cls, device):
        from fuseinfer.export.tensorrt import unavailable_reason

        return unavailable_reason(device)

    def prepare(self):
        from fuseinfer.export.onnx_export import to_onnx
        from fuseinfer.export.tensorrt import TrtDecoder, build_engine

        memo = {}
        directory, self._temporary = export_dir_for(self.model, "plain", self.dtype, memo, self.options.onnx_dir)
        if (directory / mf.MANIFEST).is_file():
            mf.check_matches(mf.read(directory), directory, model=self.model, flavour="plain", dtype=self.dtype,
                             memo=memo)
        else:
            to_onnx(self.model, directory, "plain", source=self.source.spec, memo=memo)
        self.directory = directory
        self.model = None
        _free(self.device)
        engine = directory / f"engine-{mf.DTYPE_NAMES[self.dtype]}.plan"
        if not engine.is_file():
            build_engine(directory, engine, fp16=self.dtype == torch.float16)
        self.trt = TrtDecoder(engine, directory, self.device)

    def start(self, batch_size, max_len):
        self.trt.start(batch_size, max_len)

    def end(self):
        if getattr(self, "trt", None) is not None:
            self.trt.end()

    def prefill(self, input_ids):
        return greedy(self.trt.prefill(input_ids))

    def decode_step(self, tokens):
        return greedy(self.trt.step(tokens))

    def loss(self, input_ids, labels):
        logits = self.trt.logits(input_ids).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)

    def close(self):
        self.end()
        self.trt = None
        if getattr(self, "_temporary", False):
            shutil.rmtree(self.directory.parent, ignore_errors=True)
        super().close()


def _free(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


BACKENDS = (OrtBackend, OrtPlainBackend, TensorRTBackend)
__all__ = ["OrtBackend", "OrtPlainBackend", "TensorRTBackend", "ExportError", "BACKENDS", "export_dir_for"]
