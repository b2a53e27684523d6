"""TensorRT path: build an engine from a plain ONNX export, and run it with ``execute_async_v3``.

WRITTEN AGAINST TENSORRT'S DOCUMENTED PYTHON API (TensorRT 10: ``Builder``, ``OnnxParser``,
``IOptimizationProfile.set_shape / set_shape_input``, ``build_serialized_network``, ``Runtime``,
``IExecutionContext.set_input_shape / set_tensor_address / execute_async_v3``), NOT YET RUN: it has not been tested
against an installed TensorRT (PyPI's tensorrt-cu13-libs is a stub that downloads from elsewhere; TensorRT-RTX has
no sm_90). Where ``tensorrt`` does not import, every entry point raises one ExportError saying how to install it.

Engine: the plain flavour (contrib ops are ONNX Runtime's, TensorRT's parser knows none of them). One
optimization profile covers batch 1..max_batch, new tokens 1..max_len and past 0..max_len - 1, tuned (opt) for
``opt_batch`` x one decode token after ``opt_past`` cached tokens. ``num_logits_to_keep`` feeds a Slice start, so
TensorRT treats it as a shape tensor: a host-memory input with its own value range (``set_shape_input``).

Execution: every device tensor is a torch tensor whose address is handed to the context
(``set_tensor_address``), the KV cache in the same ping-pong buffers as the ORT runtime, on torch's current
stream: no host copies per token, and no allocation, so a CUDA graph could be captured per shape (not done:
the shapes change every step with a growing past).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from fuseinfer.core import files
from fuseinfer.export import manifest as mf
from fuseinfer.export.errors import ExportError

INSTALL = ("TensorRT is not installed: pip install tensorrt (NVIDIA's wheels for your CUDA, e.g. tensorrt-cu12; "
           "they download the libraries from pypi.nvidia.com), or use the TensorRT container; the engine "
           "builder also needs a GPU")


def unavailable_reason(device: torch.device | None = None) -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return INSTALL
    if device is not None and device.type != "cuda":
        return "TensorRT runs on CUDA GPUs only: use --device cuda"
    return None


def _trt():
    reason = unavailable_reason()
    if reason:
        raise ExportError(reason)
    import tensorrt as trt

    return trt


def build_engine(onnx_dir, out, fp16: bool = False, int8: bool = False, max_batch: int = 8,
                 max_len: int | None = None, opt_batch: int = 1, opt_past: int = 512,
                 workspace_gib: float = 8.0, overwrite: bool = False) -> Path:
    """Parse ``onnx_dir``'s plain graph and serialise an engine to ``out``; returns ``out``."""
    trt = _trt()  # first: without TensorRT nothing else matters
    out = files.check_writable(out, overwrite=overwrite, flag="--out")  # before minutes of building
    manifest = mf.read(onnx_dir)
    if manifest["flavour"] != "plain":
        raise ExportError(f"{onnx_dir} is the {manifest['flavour']!r} flavour, whose onnxruntime contrib ops "
                          "TensorRT cannot parse: export with --plain for TensorRT")
    if int8:
        raise ExportError("--int8 needs a calibrator or a Q/DQ graph, which this exporter does not make yet; "
                          "build with --fp16")
    m = manifest["model"]
    max_len = max_len or m["max_positions"]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(Path(onnx_dir) / manifest["model_file"])):  # reads the external data
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT's ONNX parser rejected {onnx_dir}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    if fp16 or manifest["dtype"] == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    h, d = mf.kv_heads(manifest), m["head_dim"]
    profile = builder.create_optimization_profile()
    profile.set_shape("input_ids", (1, 1), (opt_batch, 1), (max_batch, max_len))
    profile.set_shape("attention_mask", (1, 1), (opt_batch, opt_past + 1), (max_batch, max_len))
    profile.set_shape_input("num_logits_to_keep", [0], [1], [max_len])
    for i in range(m["layers"]):
        for kv in ("key", "value"):
            profile.set_shape(f"past_{kv}_{i}", (1, h, 0, d), (opt_batch, h, opt_past, d),
                              (max_batch, h, max_len - 1, d))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError("TensorRT could not build the engine (see its log above)")
    return files.write_bytes(out, bytes(serialized), overwrite=overwrite, flag="--out")


class TrtDecoder:
    """The same interface as OrtDecoder (start / prefill / step / logits) over a TensorRT engine."""

    def __init__(self, engine_path, onnx_dir, device="cuda"):
        trt = _trt()
        self.device = torch.device(device)
        self.manifest = mf.read(onnx_dir)
        m = self.manifest["model"]
        self.layers, self.head_dim, self.vocab = m["layers"], m["head_dim"], m["vocab"]
        self.heads = mf.kv_heads(self.manifest)  # the KV cache's heads
        self.dtype = mf.DTYPES[self.manifest["dtype"]]
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise ExportError(f"TensorRT could not load {engine_path} (built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.past_names = [f"past_{kv}_{i}" for i in range(self.layers) for kv in ("key", "value")]
        self.keep_one = torch.ones(1, dtype=torch.int64)  # host memory: a shape tensor input
        self.keep_all = torch.zeros(1, dtype=torch.int64)
        self.buffers = None

    def start(self, batch_size, max_len):
        n = batch_size * self.heads * max_len * self.head_dim
        kw = dict(dtype=self.dtype, device=self.device)
        self.buffers = [[torch.empty(n, **kw), torch.empty(n, **kw)] for _ in range(2 * self.layers)]
        self.ones = torch.ones(batch_size * max_len, dtype=torch.int64, device=self.device)
        self.step_logits = torch.empty(batch_size, 1, self.vocab, **kw)
        self.max_len, self.length = max_len, 0

    def end(self):
        self.buffers = self.ones = self.step_logits = None

    def _view(self, flat, b, length):
        return flat[: b * self.heads * length * self.head_dim].view(b, self.heads, length, self.head_dim)

    def _run(self, input_ids, mask, keep, logits):
        b, s = input_ids.shape
        ctx, alive = self.context, [input_ids.contiguous(), mask.contiguous()]
        for name, t in (("input_ids", alive[0]), ("attention_mask", alive[1])):
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        ctx.set_tensor_address("num_logits_to_keep", keep.data_ptr())  # host pointer (shape tensor)
        ctx.set_tensor_address("logits", logits.data_ptr())
        for name, bufs in zip(self.past_names, self.buffers):
            past = self._view(bufs[0], b, self.length)
            ctx.set_input_shape(name, tuple(past.shape))
            ctx.set_tensor_address(name, past.data_ptr())
            ctx.set_tensor_address("present" + name[4:], self._view(bufs[1], b, self.length + s).data_ptr())
        if not ctx.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise ExportError("TensorRT execute_async_v3 failed (see its log)")
        for bufs in self.buffers:
            bufs.reverse()
        self.length += s
        return logits

    def prefill(self, input_ids, all_logits=False):
        b, p = input_ids.shape
        self.length = 0
        out = torch.empty(b, p, self.vocab, dtype=self.dtype, device=self.device) if all_logits else \
            self.step_logits[:b]
        return self._run(input_ids, self.ones[: b * p].view(b, p), self.keep_all if all_logits else self.keep_one,
                         out)

    def step(self, tokens):
        b = tokens.shape[0]
        mask = self.ones[: b * (self.length + 1)].view(b, self.length + 1)
        return self._run(tokens, mask, self.keep_one, self.step_logits[:b])

    def logits(self, input_ids):
        b, s = input_ids.shape
        self.start(b, s)
        try:
            return self.prefill(input_ids, all_logits=True)
        finally:
            self.end()
