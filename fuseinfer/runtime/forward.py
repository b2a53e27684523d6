"""The fast forward of a patched causal LM: ``model(input_ids)`` through the family's lean layer loop (on CUDA a
CUDA graph of it) instead of transformers' module calls, mask building and output plumbing, which made the patched
forward host-bound (about 6 ms for OPT-1.3b at 128 and at 512 tokens, where the GPU needs 1.8 and 2.9 ms).

``patch`` swaps the class of a patched ``*ForCausalLM`` whose family has a lean loop (``ModelFamily.lean_hidden``)
for a subclass made here (:func:`fast_class`: the same name, the same forward signature; ``unpatch`` puts the class
back). Its forward serves a call itself when the lean loop computes what the patched modules would, namely:

* ``input_ids`` (B, S) on the model's device; ``attention_mask`` None or (B, S) (any padding); ``position_ids``
  None or (B or 1, S); no ``inputs_embeds``; no ``past_key_values``, or an empty ``DynamicCache``; no
  ``output_attentions`` / ``output_hidden_states`` (neither in the call nor in the config); ``logits_to_keep`` an int
  or a 1-D tensor of positions; no other argument;
* gradients off (``torch.no_grad`` / ``torch.inference_mode``), not compiling or tracing,
  ``RuntimeConfig.prefill`` other than ``module``, and the family's ``prefill_reason`` None (eval mode, every op
  patched, no hooks, no autocast to another dtype, the fused weights intact).

Every other call runs the original forward (the patched modules), unchanged. The fast forward computes
``hidden = family.lean_hidden(...)`` at every position, ``logits = model.lm_head(hidden[:, kept])``, the loss through
``model.loss_function`` when ``labels`` are given, and returns transformers' ``CausalLMOutputWithPast`` (a tuple for
``return_dict=False``). With ``use_cache`` (the config's default) ``past_key_values`` is a ``DynamicCache`` (the one
passed in, else a new one) holding every layer's keys and values, which transformers continues from.

**CUDA graphs.** On CUDA with ``RuntimeConfig.cuda_graphs`` and prefill ``auto`` / ``graph``, the call replays a
graph of ``lean_hidden`` (plus, when a cache is wanted, every layer's k/v copied into one buffer) per (batch, length
bucket, cache or not), captured on the shape's first use (``COUNTS["forward_graph"]``; a call made while the
caller captures a graph of its own runs the lean loop into the caller's graph). The prompt is right-padded
to its bucket (a multiple of ``prefill.LENGTH_BUCKET``): attention is causal, so the padding changes no earlier
position. ``auto`` takes graphs up to ``AUTO_GRAPH_MAX_TOKENS`` rows x bucket tokens, as fast decode's prefill does.
After the replay the LM head runs on the kept positions of the graph's hidden states (a new tensor) and the k/v are
copied out of the graph's buffer in one copy (the cache holds views of that copy), so nothing returned is
overwritten by the next replay. The graphs of a model share one memory pool and live with its fast-decode sessions:
``fuseinfer.runtime.release(model)``, ``unpatch`` and a move of the model's tensors (``model.to``, ``.half()``: a
sample of the tensors' addresses is checked at each call) drop them. A single weight replaced after the first call
(``param.data = t``, ``load_state_dict(..., assign=True)``; copies into the weights are fine) is not seen by a graph
captured before: call ``fuseinfer.runtime.release(model)`` after it.
"""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import time
import weakref

import torch
from torch import nn

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.state import model_lock, patch_state
from fuseinfer.runtime.cache import COUNTS
from fuseinfer.runtime.decode import SESSIONS_ATTR
from fuseinfer.runtime.graphs import warm_and_capture

KEY = "forward"  # sessions[(KEY, rows, length bucket, kv)] -> HiddenGraph
# the arguments the fast forward takes (any other one set to something but None / False sends the call to the
# patched modules)
_TAKES = frozenset({"input_ids", "attention_mask", "past_key_values", "inputs_embeds", "labels", "use_cache",
                    "position_ids", "logits_to_keep", "return_dict", "output_attentions", "output_hidden_states",
                    "cache_position", "num_items_in_batch"})


# ---- the class patch swaps in ----

_classes: dict[type, type] = {}
_PREFIX, _SUFFIX = "FastForward<", ">"


def _qualname(base: type) -> str:
    """The fast class's ``__qualname__``: the base class's module and name without dots (pickle reads a dotted
    name as a path of attributes), which this module's ``__getattr__`` turns back into the class."""
    return f"{_PREFIX}{base.__module__}:{base.__qualname__}{_SUFFIX}".replace(".", "/")


def __getattr__(name: str):
    """Unpickling a patched model (``torch.load``) finds its class here by the name :func:`_qualname` gave it."""
    if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
        module, _, qualname = name[len(_PREFIX):-len(_SUFFIX)].replace("/", ".").partition(":")
        base = importlib.import_module(module)
        for part in qualname.split("."):
            base = getattr(base, part)
        return fast_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fast_class(base: type) -> type:
    """The subclass of ``base`` (a transformers ``*ForCausalLM``) whose forward takes the fast path where it applies
    and otherwise calls ``base.forward``; one per base class. It keeps ``base``'s name (so ``save_pretrained``'s
    architectures, pipelines and reprs see the original) and its forward's signature (transformers inspects it)."""
    cls = _classes.get(base)
    if cls is None:
        original = base.forward
        params = inspect.signature(original).parameters
        names = tuple(n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD)[1:]  # (without self)

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch.jit.is_tracing():
                out = fast_forward(self, names, args, kwargs)
                if out is not None:
                    return out
            # (``original``, not super(): unpatch may have restored the class meanwhile)
            return original(self, *args, **kwargs)

        cls = type(base.__name__, (base,), {"forward": forward, "__module__": __name__,
                                            "__qualname__": _qualname(base), "_fuseinfer_base": base})
        _classes[base] = cls
    return cls


def fast_class_for(model: nn.Module, family) -> type | None:
    """The class ``patch`` gives ``model`` (a :func:`fast_class`), or None where the fast forward cannot serve it:
    not a causal LM of the family's architectures, or a family without a lean loop."""
    from fuseinfer.models.base import ModelFamily

    name = type(model).__name__
    if not name.endswith("ForCausalLM") or name not in family.architectures \
            or type(family).lean_hidden is ModelFamily.lean_hidden:
        return None
    return fast_class(type(model))


# ---- the fast path ----

def _arguments(names: tuple, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name, or None when they are not all ones the fast forward takes."""
    if len(args) > len(names):
        return None
    kw = dict(zip(names, args))
    for k, v in kwargs.items():
        if k in kw:  # given twice: the original forward raises transformers' error
            return None
        kw[k] = v
    for k, v in kw.items():
        if k not in _TAKES and v is not None and v is not False:
            return None
    return kw


def _keep(logits_to_keep, s: int):
    """The positions whose logits are wanted (transformers' rule): a slice, a 1-D index tensor, or None (another
    form, left to the patched modules)."""
    if isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool):
        return slice(-logits_to_keep if logits_to_keep > 0 else 0, s) if logits_to_keep >= 0 else None
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1 and \
            not logits_to_keep.is_floating_point() and logits_to_keep.dtype != torch.bool:
        return logits_to_keep
    return None


def fast_forward(model: nn.Module, names: tuple, args: tuple, kwargs: dict):
    """The call's ``CausalLMOutputWithPast`` (or tuple) through the lean loop / its graph, or None where the
    patched modules must serve it (see the module docstring). Gradients are off (the caller checked)."""
    kw = _arguments(names, args, kwargs)
    if kw is None or kw.get("inputs_embeds") is not None:
        return None
    ids = kw.get("input_ids")
    if type(ids) is not torch.Tensor or ids.dim() != 2 or ids.numel() == 0 or ids.is_floating_point():
        return None
    b, s = ids.shape
    config = model.config
    for flag in ("output_attentions", "output_hidden_states"):
        value = kw.get(flag)
        if value or (value is None and getattr(config, flag, False)):
            return None
    mask, pos = kw.get("attention_mask"), kw.get("position_ids")
    if mask is not None and (type(mask) is not torch.Tensor or mask.shape != ids.shape or mask.device != ids.device):
        return None
    if pos is not None and (type(pos) is not torch.Tensor or pos.dim() != 2 or pos.shape[1] != s
                            or pos.shape[0] not in (1, b) or pos.device != ids.device):
        return None
    keep = _keep(kw.get("logits_to_keep", 0), s)
    if keep is None:
        return None
    cache = kw.get("past_key_values")
    if cache is not None:
        from transformers import DynamicCache

        if type(cache) is not DynamicCache or cache.get_seq_length() != 0:
            return None
    with model_lock(model):  # (patch / unpatch in another thread wait for this call, and it for them)
        state = patch_state(model)
        if state is None or state.config.runtime.prefill == "module":
            return None
        family = state.family
        # (weights=False: the graph checks its own; the eager loop checks them below)
        if family.prefill_reason(model, weights=False) is not None:
            return None
        dev = next(model.parameters()).device
        if ids.device != dev:
            return None
        use_cache = kw.get("use_cache")
        if use_cache is None:
            use_cache = getattr(config, "use_cache", False)
        want_kv = cache is not None or bool(use_cache)
        positions = family.forward_positions(model, ids, mask) if pos is None else pos.expand(b, s)
        key_mask = None if mask is None else mask.bool()
        graph = _graph_for(model, state, dev, b, s, want_kv)
        if graph is not None:
            hidden, kv = graph.run(ids, positions, key_mask)
            hidden = hidden[:, :s]  # (B, S, E) of the graph's (B, bucket, E)
            if kv is not None:  # (layers, B, S, 2, Hkv, D): one copy out of the graph's buffer
                kv = _kv_views(kv[:, :, :s].clone())
        else:
            if family.prefill_reason(model) is not None:  # the fused weights, which the loop reads now
                return None
            kv = [] if want_kv else None
            hidden = family.lean_hidden(model, ids, positions, key_mask, kv)  # (B, S, E)
        logits = model.lm_head(hidden[:, keep]).contiguous()  # (B, kept, V)
        if cache is None and use_cache:
            cache = _new_cache(model, config)
        COUNTS["fast_forward"] += 1
    if cache is not None:
        _fill(cache, kv)
    loss = None
    labels = kw.get("labels")
    if labels is not None:
        extra = {"num_items_in_batch": kw["num_items_in_batch"]} if kw.get("num_items_in_batch") is not None else {}
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **extra)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
    return_dict = kw.get("return_dict")
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    return out if return_dict else out.to_tuple()


def _sessions(model: nn.Module):
    """The model's fast-decode sessions (where its forward graphs and cache template live: release drops them)."""
    from fuseinfer.runtime.decode import _Sessions

    sessions = model.__dict__.get(SESSIONS_ATTR)
    if not isinstance(sessions, _Sessions):
        sessions = model.__dict__[SESSIONS_ATTR] = _Sessions()
    return sessions


def _new_cache(model: nn.Module, config):
    """An empty ``DynamicCache(config=config)``, copied from one made once per model: making it reads the whole
    config (hundreds of microseconds a call on transformers 5.23). Its layers are new objects, uninitialised like
    the template's."""
    sessions = _sessions(model)
    cached = sessions.get((KEY, "cache"))
    if cached is None or cached[0] is not config:
        from transformers import DynamicCache

        cached = sessions[(KEY, "cache")] = (config, DynamicCache(config=config))
    template = cached[1]
    cache = _shallow_copy(template)
    cache.layers = list(map(_shallow_copy, template.layers))
    return cache


_plain_types: dict[type, bool] = {}  # class -> whether copy.copy of its instances is a new instance + its __dict__


def _shallow_copy(obj):
    """``copy.copy(obj)``: for a class that customises nothing of copying (no ``__copy__``, ``__reduce__``,
    ``__reduce_ex__``, ``__getstate__``, no non-empty slots), what copy does, a new instance with the same
    attributes, without the reduce protocol's calls (~25 copies a forward: the cache and each layer's)."""
    cls = type(obj)
    plain = _plain_types.get(cls)
    if plain is None:
        plain = _plain_types[cls] = (
            not hasattr(cls, "__copy__") and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__ and cls.__getstate__ is object.__getstate__
            and not any(vars(c).get("__slots__") for c in cls.__mro__) and hasattr(obj, "__dict__"))  # (ABC's: ())
    if not plain:
        return copy.copy(obj)
    new = cls.__new__(cls)
    new.__dict__.update(obj.__dict__)
    return new


def _fill(cache, kv: list) -> None:
    """Put every layer's (k, v) (B, Hkv, S, D) into an empty DynamicCache, as its ``update`` would (an unfilled
    ``DynamicLayer`` takes the tensors as they are: ``update`` would copy each onto an empty tensor)."""
    from transformers.cache_utils import DynamicLayer

    layers = cache.layers
    for i, (k, v) in enumerate(kv):
        layer = layers[i] if i < len(layers) else None
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layer.dtype, layer.device = k.dtype, k.device
            layer.keys, layer.values = k, v
            layer.is_initialized = True
        else:  # (sliding-window layers keep their window; a cache made without a config adds its layers)
            cache.update(k, v, i)


# ---- CUDA graphs ----

def _graph_for(model: nn.Module, state, dev: torch.device, rows: int, s: int, kv: bool):
    """The model's graph on ``dev`` for ``rows`` prompts of ``s`` tokens (captured on first use), or None where
    graphs do not apply: not CUDA, CUDA graphs off, prefill ``lean``, (auto) too many tokens, the caller capturing,
    or an int8 model at decode-sized inputs (its linears run the GEMV there, which a padded bucket would switch to
    the prefill GEMM)."""
    from fuseinfer.layers.linear import DECODE_ROWS  # (imports transformers: not at ``import fuseinfer``)
    from fuseinfer.runtime.prefill import AUTO_GRAPH_MAX_TOKENS, length_bucket

    runtime = state.config.runtime
    if runtime.prefill not in ("auto", "graph") or not runtime.cuda_graphs or dev.type != "cuda":
        return None
    length = length_bucket(s)
    if runtime.prefill == "auto" and rows * length > AUTO_GRAPH_MAX_TOKENS:
        return None
    if torch.cuda.is_current_stream_capturing():  # a caller capturing the call itself gets the lean loop captured
        return None
    if rows * s <= DECODE_ROWS and state.config.quant is not None:
        return None
    sessions = _sessions(model)
    graphs = {k: g for k, g in sessions.items() if isinstance(g, HiddenGraph)}
    if graphs and not next(iter(graphs.values())).probe.same():  # the model's tensors moved: every graph is stale
        for k in graphs:
            del sessions[k]
        graphs = {}
    key = (KEY, rows, length, kv)
    graph = graphs.get(key)
    if graph is None:
        if state.family.prefill_reason(model) is not None:  # the fused weights, which the capture reads
            return None
        pool = next((g.pool for g in graphs.values()), None)
        with torch.cuda.device(dev):
            graph = sessions[key] = HiddenGraph(model, state.family, dev, rows, length, kv, pool)
    return graph


class _Probe:
    """Where a sample of the model's tensors were when a graph was captured: ``model.to`` / ``.half()`` /
    ``.cuda()`` move every tensor, which ``same()`` sees at the cost of a few reads (comparing every tensor's address
    at each call would cost more host time than the graph saves on small calls)."""

    SAMPLE = 16

    def __init__(self, model: nn.Module):
        slots = [(d, name) for m in model.modules() for d in (m._parameters, m._buffers)
                 for name, t in d.items() if t is not None]
        step = max(1, len(slots) // self.SAMPLE)
        self.slots = slots[::step] + slots[-1:]
        self.where = self._where()

    def _where(self) -> tuple:
        return tuple(d[name].data_ptr() if d.get(name) is not None else None for d, name in self.slots)

    def same(self) -> bool:
        return self._where() == self.where


class _KVSink(list):
    """``kv_out`` for a graph: each layer's (k, v) is copied into one (layers, B, L, 2, Hkv, D) buffer as it is
    appended (so the graph's pool keeps no layer's q/k/v output alive, and the caller copies the k/v out at once).
    Token-major, each token's keys then values: a layer's copy reads whole rows of the q/k/v output (where k and v
    sit side by side in one tensor, as OPT's fused q/k/v GEMM writes them, one copy serves both), not a transposing
    copy per head; the cache gets (B, Hkv, S, D) views of it (:func:`_kv_views`)."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers, self.count, self.buffer = layers, 0, None

    def append(self, kv) -> None:
        k, v = kv  # (B, Hkv, L, D) each
        if self.buffer is None:
            b, h, length, d = k.shape
            self.buffer = k.new_empty((self.layers, b, length, 2, h, d))
        if self.count >= self.layers:
            raise FuseInferError(f"the lean loop gave more than {self.layers} layers' keys and values")
        dst = self.buffer[self.count]  # (B, L, 2, Hkv, D)
        pair = _side_by_side(k, v)
        if pair is not None:
            dst.copy_(pair)
        else:
            dst[:, :, 0].copy_(k.transpose(1, 2))
            dst[:, :, 1].copy_(v.transpose(1, 2))
        self.count += 1


def _side_by_side(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k, v (B, Hkv, L, D) as one (B, L, 2, Hkv, D) view where v's elements sit at k's offset by Hkv*D with the same
    strides, each token's heads contiguous (views of one (B, L, ..., k, v) row), else None."""
    b, h, length, d = k.shape
    if (v.shape != k.shape or v.dtype != k.dtype or v.stride() != k.stride() or k.stride(3) != 1
            or k.stride(1) != d or v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or v.storage_offset() != k.storage_offset() + h * d):
        return None
    sb, _, sl, _ = k.stride()
    return k.as_strided((b, length, 2, h, d), (sb, sl, h * d, d, 1), k.storage_offset())


def _kv_views(kv: torch.Tensor) -> list:
    """[(k, v)] per layer, each (B, Hkv, S, D), views of kv (layers, B, S, 2, Hkv, D)."""
    return [(layer[:, :, 0].transpose(1, 2), layer[:, :, 1].transpose(1, 2)) for layer in kv.unbind(0)]


class HiddenGraph:
    """A CUDA graph of ``family.lean_hidden`` for ``rows`` prompts right-padded to ``length`` tokens (and, with
    ``kv``, every layer's keys and values in one buffer)."""

    def __deepcopy__(self, memo):  # like the sessions: copies and pickles of the model start without graphs
        return None

    def __reduce__(self):
        return type(None), ()

    def __init__(self, model: nn.Module, family, dev: torch.device, rows: int, length: int, kv: bool, pool=None):
        """pool: another graph's memory pool to share (graphs of one model never run concurrently: calls hold the
        model's lock, and each replay's outputs are consumed before the next)."""
        COUNTS["forward_graph"] += 1
        self.model, self.family = weakref.proxy(model), family
        self.probe = _Probe(model)  # (the probe holds the modules' dicts, not the model: no reference cycle)
        self.layers = model.config.num_hidden_layers
        # (normal tensors, also when the first call runs under inference_mode: later calls copy into them)
        with torch.inference_mode(False), torch.no_grad():
            self.ids = torch.zeros(rows, length, dtype=torch.long, device=dev)  # (B, L); padding: any valid id
            self.pos = torch.zeros(rows, length, dtype=torch.long, device=dev)  # (B, L)
            self.key_mask = torch.ones(rows, length, dtype=torch.bool, device=dev)  # (B, L)
            self.kv = kv
            self.graph = torch.cuda.CUDAGraph()
            self.hidden, self.kv_buffer = None, None
            torch.cuda.synchronize(dev)
            before, start = torch.cuda.memory_reserved(dev), time.perf_counter()
            self._capture(pool)
            torch.cuda.synchronize(dev)
        self.capture_ms = (time.perf_counter() - start) * 1e3  # two warm-up runs + the capture
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before  # what the capture reserved (0 when shared)
        self.pool = self.graph.pool()

    def _forward(self):
        sink = _KVSink(self.layers) if self.kv else None
        hidden = self.family.lean_hidden(self.model, self.ids, self.pos, self.key_mask, sink)  # (B, L, E)
        if sink is not None and sink.count != self.layers:
            raise FuseInferError(f"the lean loop gave {sink.count} layers' keys and values, the model has "
                                 f"{self.layers}")
        return hidden, (sink.buffer if sink is not None else None)

    def _capture(self, pool) -> None:
        self.hidden, self.kv_buffer = warm_and_capture(self.graph, self._forward, self.ids.device, pool)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None):
        """ids, positions (B, S <= length), key_mask (B, S) bool or None -> (hidden (B, length, E), k/v buffer
        (layers, B, length, 2, Hkv, D) or None), the graph's own outputs: valid at positions [0, S) until the next
        replay. The padding [S, length) keeps what earlier calls left there (valid ids and positions): only its
        own positions read it (causal attention)."""
        s = ids.shape[1]
        with torch.cuda.device(self.ids.device):  # (the graph's device, whichever is current)
            self.ids[:, :s].copy_(ids)
            self.pos[:, :s].copy_(positions)
            if key_mask is None:
                self.key_mask[:, :s].fill_(True)
            else:
                self.key_mask[:, :s].copy_(key_mask)
            self.graph.replay()
        return self.hidden, self.kv_buffer


def graph_stats(model) -> dict:
    """{(rows, length bucket, kv): {'capture_ms', 'pool_bytes'}} of the model's forward graphs (the benchmark)."""
    sessions = model.__dict__.get(SESSIONS_ATTR) or {}
    return {k[1:]: {"capture_ms": g.capture_ms, "pool_bytes": g.pool_bytes}
            for k, g in sessions.items() if isinstance(g, HiddenGraph)}
