"""Run an exported directory with ONNX Runtime: ``OrtDecoder(dir, device)`` with IO binding on torch tensors.

Everything a step touches lives in torch tensors on the run's device, bound to ONNX Runtime by address
(``IOBinding.bind_input/bind_output(name, "cuda"|"cpu", index, numpy dtype, shape, t.data_ptr())``): input ids,
the mask, the KV cache and the logits; nothing is copied through the host per token (the one host value is
``num_logits_to_keep``, a 1-element int64 CPU tensor: it feeds a Slice's ``starts``, which ORT reads on the host
anyway). The same binding code runs on CPU (CPU provider), which is how CI covers it.

CUDA streams: ORT runs on a stream of its own that this class creates with torch (provider option
``user_compute_stream``; torch's default stream cannot be handed over: its handle is 0, which ORT takes for "no
stream" and then silently runs on an internal stream unordered with torch's). Each run is ordered with torch's
current stream by two event waits (``ort_stream.wait_stream(current)`` before, ``current.wait_stream(ort_stream)``
after), so torch's writes to the inputs land before ORT reads them and torch's reads of the outputs (argmax,
CUDA-event timing) come after ORT wrote them, with no host synchronisation (run option
``disable_synchronize_execution_providers``).

KV cache: the graph reads past (B, H, P, D) and writes present (B, H, P + S, D). Per layer and per key/value two
flat buffers of B * H * max_len * D elements are allocated once (``start``), and each step reads one as past and
writes the other as present, then swaps (ping-pong): no allocation per step. ONNX Runtime copies the past into the
present inside the attention (the graph's contract), O(P) per step; a shared in-place buffer would need
MultiHeadAttention's past_present_share_buffer mode (beam-search oriented: past_sequence_length and
cache_indirection inputs), not used here. A past of length 0 (prefill) is bound with address 0, as ORT itself
represents an empty tensor.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import torch

from fuseinfer.export import manifest as mf
from fuseinfer.export.errors import ExportError

NP_TYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.int64: np.int64}


def import_onnxruntime(device: torch.device):
    """onnxruntime, checked for the device; ExportError naming the package to install otherwise."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise ExportError("onnxruntime is not installed: pip install onnxruntime (CPU) or onnxruntime-gpu (CUDA)")
    if device.type == "cuda" and torch.cuda.is_available():
        # onnxruntime-gpu links the CUDA, cuBLAS and cuDNN libraries that torch's wheels ship: have torch load
        # them into the process first (cuDNN is loaded lazily by torch otherwise)
        torch.cuda.init()
        torch.backends.cudnn.version()
    import onnxruntime as ort

    if device.type == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ExportError(f"onnxruntime {ort.__version__} has no CUDA execution provider (providers: "
                          f"{', '.join(ort.get_available_providers())}): pip install onnxruntime-gpu (a CUDA "
                          f"{torch.version.cuda} build), import torch before onnxruntime, or use --device cpu")
    return ort


def unavailable_reason(device: torch.device) -> str | None:
    try:
        import_onnxruntime(device)
    except ExportError as exc:
        return str(exc)
    return None


def check_providers(session, device: torch.device, version: str) -> None:
    """ORT falls back to the CPU provider, with only a log line, when the CUDA provider's libraries do not load
    (e.g. a cuDNN or cuBLAS of another CUDA major); a CUDA run must not silently become a CPU one."""
    used = session.get_providers()
    if device.type == "cuda" and "CUDAExecutionProvider" not in used:
        raise ExportError(f"onnxruntime {version} created the session without the CUDA execution provider (it "
                          f"uses {', '.join(used)}): its CUDA libraries did not load; install the onnxruntime-gpu "
                          f"build for CUDA {torch.version.cuda} and import torch before onnxruntime")


def device_used_mib(device: torch.device) -> float | None:
    """Memory in use on the whole GPU (driver's count: ORT's arena, cuBLAS workspaces, torch's cached blocks,
    and any other process), MiB; None on CPU. ORT allocates outside torch's allocator, so torch's own peak
    counters cannot see it."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


class OrtDecoder:
    """A loaded export: ``start`` a batch, ``prefill`` a prompt, ``step`` one token at a time, or ``logits``."""

    def __init__(self, directory, device="cpu", *, model=None, config=None, flavour=None, dtype=None,
                 profile_prefix: str | None = None, threads: int | None = None):
        self.directory = Path(directory)
        self.device = torch.device(device)
        ort = import_onnxruntime(self.device)
        self.manifest = mf.read(self.directory)
        mf.check_matches(self.manifest, self.directory, model=model, config=config, flavour=flavour, dtype=dtype)
        m = self.manifest["model"]
        self.layers, self.head_dim, self.vocab = m["layers"], m["head_dim"], m["vocab"]
        self.heads = mf.kv_heads(self.manifest)  # the KV cache's heads (fewer with grouped-query attention)
        self.dtype = mf.DTYPES[self.manifest["dtype"]]
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        if profile_prefix:
            opts.enable_profiling = True
            opts.profile_file_prefix = profile_prefix
        self.stream = None
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.stream = torch.cuda.Stream(self.device)  # ORT's compute stream (see the module docstring)
            providers = [("CUDAExecutionProvider", {"device_id": index,
                                                    "user_compute_stream": str(self.stream.cuda_stream),
                                                    "arena_extend_strategy": "kSameAsRequested"}),
                         "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        start = time.perf_counter()
        try:
            self.session = ort.InferenceSession(str(self.directory / self.manifest["model_file"]), opts,
                                                providers=providers)
        except Exception as exc:
            hint = (" (this onnxruntime's CPU provider may lack fp16 kernels for these ops: export with --dtype "
                    "fp32 for --device cpu)" if self.device.type == "cpu" and self.dtype != torch.float32 else "")
            raise ExportError(f"onnxruntime {ort.__version__} could not load {self.directory}: "
                              f"{str(exc).strip().splitlines()[0]}{hint}") from None
        self.load_s = time.perf_counter() - start
        check_providers(self.session, self.device, ort.__version__)
        self.run_options = ort.RunOptions()
        if self.device.type == "cuda":  # ordered with torch by stream waits: no need to wait for the GPU after a run
            self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.past_names = [f"past_{kv}_{i}" for i in range(self.layers) for kv in ("key", "value")]
        self.present_names = ["present" + name[4:] for name in self.past_names]
        self.kind = "cuda" if self.device.type == "cuda" else "cpu"
        self.index = self.device.index or 0
        self.keep_one = torch.ones(1, dtype=torch.int64)  # CPU: a host input by design
        self.keep_all = torch.zeros(1, dtype=torch.int64)
        self.buffers = self.ptrs = None
        self.host_bind_s, self.runs = 0.0, 0  # host time spent building IO bindings, and the number of runs

    # --- binding helpers
    def _bind_in(self, binding, name, t: torch.Tensor, alive: list):
        t = t.contiguous()
        alive.append(t)  # a contiguous copy must outlive the run that reads its address
        kind, index = ("cuda", t.device.index or 0) if t.is_cuda else ("cpu", 0)
        binding.bind_input(name, kind, index, NP_TYPES[t.dtype], tuple(t.shape), t.data_ptr())

    def _bind_out(self, binding, name, t: torch.Tensor):
        binding.bind_output(name, self.kind, self.index, NP_TYPES[t.dtype], tuple(t.shape), t.data_ptr())

    # --- generation
    def start(self, batch_size: int, max_len: int) -> None:
        """Allocate the ping-pong KV buffers, the logits buffer and an all-ones mask for ``batch_size`` x
        ``max_len`` (untimed)."""
        n = batch_size * self.heads * max_len * self.head_dim
        kw = dict(dtype=self.dtype, device=self.device)
        self.buffers = [[torch.empty(n, **kw), torch.empty(n, **kw)] for _ in range(2 * self.layers)]
        # the buffers' addresses, (past, present) per cache tensor, swapped after each run: binding by address
        # and shape needs no tensor views per step (the IO binding is most of the host time of a decode step)
        self.ptrs = [(a.data_ptr(), b.data_ptr()) for a, b in self.buffers]
        self.ones = torch.ones(batch_size * max_len, dtype=torch.int64, device=self.device)
        self.step_logits = torch.empty(batch_size, 1, self.vocab, **kw)
        self.batch, self.max_len, self.length, self.mask = batch_size, max_len, 0, None

    def end(self) -> None:
        self.buffers = self.ptrs = self.ones = self.step_logits = self.mask = None

    def _run(self, input_ids, mask, keep, logits_out) -> torch.Tensor:
        b, s = input_ids.shape
        if self.length + s > self.max_len:
            raise ExportError(f"{self.length + s} tokens exceed the {self.max_len} given to start()")
        t0 = time.perf_counter()
        binding, alive = self.session.io_binding(), []
        self._bind_in(binding, "input_ids", input_ids, alive)
        self._bind_in(binding, "attention_mask", mask, alive)
        self._bind_in(binding, "num_logits_to_keep", keep, alive)
        self._bind_out(binding, "logits", logits_out)
        past = (b, self.heads, self.length, self.head_dim)  # (B, H, P, D) at the start of each flat buffer
        present = (b, self.heads, self.length + s, self.head_dim)
        kind, index, np_type = self.kind, self.index, NP_TYPES[self.dtype]
        for past_name, present_name, (past_ptr, present_ptr) in zip(self.past_names, self.present_names, self.ptrs):
            # an empty past (prefill) is bound at address 0, as torch's data_ptr of an empty view gives and ORT
            # represents a tensor of no elements
            binding.bind_input(past_name, kind, index, np_type, past, past_ptr if self.length else 0)
            binding.bind_output(present_name, kind, index, np_type, present, present_ptr)
        self.host_bind_s += time.perf_counter() - t0
        self.runs += 1
        if self.stream is None:
            self.session.run_with_iobinding(binding, self.run_options)
        else:
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)  # ORT reads what torch wrote (ids, mask, KV, ...)
            self.session.run_with_iobinding(binding, self.run_options)
            current.wait_stream(self.stream)  # torch reads logits / frees the inputs after ORT is done
        self.ptrs = [(present_ptr, past_ptr) for past_ptr, present_ptr in self.ptrs]  # present is the next past
        self.length += s
        return logits_out

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """A fresh sequence: input_ids (B, P) -> logits of the last position (B, 1, V) (all: (B, P, V))."""
        b, p = input_ids.shape
        self.length = 0
        self.mask = None if attention_mask is None or bool(attention_mask.all()) else \
            attention_mask.to(self.device, torch.int64).contiguous()
        full = self.ones[: b * p].view(b, p) if self.mask is None else self.mask
        out = torch.empty(b, p, self.vocab, dtype=self.dtype, device=self.device) if all_logits else \
            self.step_logits[:b]
        return self._run(input_ids.to(self.device), full, self.keep_all if all_logits else self.keep_one, out)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, 1) -> logits (B, 1, V), the view of a buffer the next step overwrites."""
        b = tokens.shape[0]
        if self.mask is None:
            mask = self.ones[: b * (self.length + 1)].view(b, self.length + 1)
        else:
            self.mask = torch.cat([self.mask, self.mask.new_ones(b, 1)], dim=1)
            mask = self.mask
        return self._run(tokens.to(self.device), mask, self.keep_one, self.step_logits[:b])

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """All logits (B, S, V) of one fresh sequence (no cache kept): perplexity and tests. A generation in
        progress (``start``/``prefill``/``step``) is left as it was."""
        b, s = input_ids.shape
        names = ("buffers", "ptrs", "ones", "step_logits", "batch", "max_len", "length", "mask")
        saved = {k: getattr(self, k, None) for k in names}
        self.start(b, s)
        try:
            return self.prefill(input_ids, attention_mask, all_logits=True)
        finally:
            for k, v in saved.items():
                setattr(self, k, v)

    def end_profiling(self) -> str | None:
        return self.session.end_profiling() if self.session.get_session_options().enable_profiling else None
