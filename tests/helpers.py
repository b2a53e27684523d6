"""Helpers shared by the op tests (tests/ops/): the device parameter, the dtype tolerance rule, the kernel-path
probes of the CUDA extension, and hypothesis settings sized per device.

Import with ``from helpers import ...`` (tests/ is on sys.path through its rootdir conftest, as for ``conftest``).
Property tests take ``given``, ``assume`` and ``st`` from here: where hypothesis is not installed (a GPU machine
without the test extra) they skip with that reason instead of failing the import of every op test.

Tolerance rule (flash-attention's): |ours - ref| <= 2 * |torch_same_dtype - ref| + atol (max over the tensor),
where ``ref`` runs the op's reference on the same inputs upcast (fp32 for fp16/bf16 inputs, fp64 for fp32 ones)
and ``torch_same_dtype`` is plain PyTorch in the inputs' dtype.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

try:
    from hypothesis import HealthCheck, assume, example, given, settings
    from hypothesis import strategies as st
    HYPOTHESIS_MISSING = None
except ImportError:  # (a machine without the test extra: the property tests skip, saying so; the rest runs)
    HYPOTHESIS_MISSING = "hypothesis is not installed (pip install hypothesis; setup.py's test extra has it)"

    class _Missing:
        """Stands in for hypothesis's strategies, HealthCheck and assume: any attribute or call gives itself."""
        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

        def __or__(self, other):
            return self

    st = HealthCheck = assume = _Missing()

    def settings(*args, **kwargs):
        return lambda f: f

    example = settings

    def given(*args, **kwargs):
        def skip_instead(f):
            def skipped():  # (no parameters: pytest must not look for fixtures named like the drawn arguments)
                pytest.skip(HYPOTHESIS_MISSING)
            skipped.__name__, skipped.__doc__ = f.__name__, f.__doc__
            return skipped
        return skip_instead

# every op test runs on the CPU; the CUDA param carries the gpu mark, so CPU-only runs list it as skipped
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
LOWP = [torch.float16, torch.bfloat16]


def ref_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the reference runs in for inputs of ``dtype``."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def up(t, dtype=torch.float32):
    """``t`` in ``dtype`` (None stays None): the reference's inputs."""
    return None if t is None else t.to(dtype)


def lowp_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Absolute slack for the rule. fp16 / bf16: half a unit in the last place at the largest reference value (a
    tiny tensor's values may all round exactly in PyTorch and one of ours by one rounding step the other way).
    fp32: 1e-5 relative to that value (the fp32 kernels' tolerance before the rule: their error is summation order,
    not one rounding, and PyTorch's can be as small as half an ulp)."""
    big = ref.abs().max().item() if ref.numel() else 0.0
    if dtype == torch.float32:
        return 1e-5 * max(big, 1.0)
    return 0.5 * torch.finfo(dtype).eps * big + 1e-6


def assert_lowp_close(ours, torch_lowp, ref, what="", atol: float = 1e-6):
    """|ours - ref| <= 2 * |torch_lowp - ref| + atol, max over the tensor; ``ref`` in a higher precision."""
    assert ours.shape == torch_lowp.shape == ref.shape, f"{what}: shapes {ours.shape}, {torch_lowp.shape}, {ref.shape}"
    if ref.numel() == 0:
        return
    ref = ref.double()
    ours_err = (ours.double() - ref).abs().max().item()
    torch_err = (torch_lowp.double() - ref).abs().max().item()
    assert not math.isnan(ours_err), f"{what}: NaN in ours"
    assert ours_err <= 2 * torch_err + atol, f"{what}: ours {ours_err:.3g} vs torch {torch_err:.3g} (atol {atol:.3g})"


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB."""
    return 10 * math.log10(ref.float().pow(2).sum().item() / (ref.float() - approx.float()).pow(2).sum().item())


def rope_cache_inputs(device, dtype, b: int, s: int, d: int, kv_heads: int, t: int, rotate: bool = True):
    """(cos, sin, k_cache, v_cache, slots) for a q/k/v op with the rotary and the cache write: cos and sin (B, S, D)
    of random angles (both None without ``rotate``), random caches (B, Hkv, T, D), slots the last S of T (S,)."""
    ang = torch.rand(b, s, d // 2, device=device) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    if not rotate:
        cos = sin = None
    caches = [torch.randn(b, kv_heads, t, d, device=device).to(dtype) for _ in range(2)]
    return cos, sin, caches[0], caches[1], torch.arange(t - s, t, device=device)


def step_cache_copy(layers: int, args: dict, slot: int, dtype):
    """A StaticKVCache (activations ``dtype``) holding copies of a decode step's caches ``args`` (their scales too
    when they are FP8), its key mask and one write slot for all rows: what the patched modules' decode step reads
    where the one-kernel step reads ``args``."""
    from fuseinfer.ops.kv_cache import FP8_DTYPE
    from fuseinfer.runtime.cache import StaticKVCache

    k0 = args["k_caches"][0]
    fp8 = bool(args.get("kv_scales"))
    cache = StaticKVCache(layers, k0.shape[0], k0.shape[1], k0.shape[3], k0.shape[2], dtype, k0.device,
                          kv_dtype=FP8_DTYPE if fp8 else None)
    if fp8:
        cache.kv_scales = [sc.clone() for sc in args["kv_scales"]]
    cache.keys = [c.clone() for c in args["k_caches"]]
    cache.values = [c.clone() for c in args["v_caches"]]
    cache.key_mask = args["key_mask"]
    cache.write_idx = torch.tensor([slot], device=k0.device)
    return cache


def examples(device: str, cpu: int, cuda: int):
    """Hypothesis settings for a property test on ``device``: few examples on the CPU (CI has 2 cores; there the ops
    run their references, so the examples mostly exercise shapes and the op plumbing), more on a GPU (the kernels).
    No deadline (first calls compile or tune), no example database written into the checkout."""
    slow = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    return settings(max_examples=cpu if device == "cpu" else cuda, deadline=None, database=None,
                    suppress_health_check=slow)


def require_kernel():
    """Fail (not skip) a GPU test of a kernel when the extension is not built: it would test the reference."""
    from fuseinfer.core.extension import extension

    if extension() is None:
        pytest.fail("fuseinfer._C is not built: the CUDA kernel cannot be tested")


def paths_taken(call):
    """call()'s result and the extension's paths it took ({name: calls}, csrc/path_counts.h): a test that
    means to exercise one kernel asserts it, since a silent fallback to another would pass the numerical checks."""
    from fuseinfer.core.extension import extension
    before = extension().path_counts()
    out = call()
    after = extension().path_counts()
    return out, {name: after[name] - before[name] for name in after if after[name] != before[name]}


def record_kernel_calls(monkeypatch) -> list[str]:
    """The list that the extension's kernel entry points append their names to while the test runs."""
    from fuseinfer.core import extension as _ext

    class Recording:  # the loaded extension, noting every kernel an op calls
        def __init__(self, ext):
            self.ext = ext

        def __getattr__(self, name):
            attr = getattr(self.ext, name)
            if name not in ("add_layer_norm", "linear_epilogue", "attention", "kv_cache_append", "decode_step",
                            "emit_tokens", "add_rms_norm", "silu_mul", "qkv_rope", "qkv_rope_append"):
                return attr
            return lambda *args, **kwargs: calls.append(name) or attr(*args, **kwargs)

    calls = []
    monkeypatch.setattr(_ext, "_ext", Recording(_ext.extension()))
    return calls


needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs an sm_90 GPU (H100/H200)")


def wgmma_available() -> bool:
    """Whether this GPU and build run the sm_90 wgmma attention prefill."""
    import fuseinfer
    return torch.cuda.get_device_capability() == (9, 0) and fuseinfer.cuda_extension_available()


def state(model) -> dict:
    """A copy of the model's state dict (to check later that a refused call left the model untouched)."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model, before: dict) -> None:
    """The model's tensors are bit for bit those of ``before`` (a ``state(model)`` taken earlier)."""
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k


# ---- the lean prefill loop against the patched modules (tests/quant, tests/runtime) ----

def cuda_kernel_names(fn) -> list[str]:
    """Names of the CUDA kernels fn() launches, in order (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def fuseinfer_op_counts(fn):
    """Counter of fuseinfer::* op calls during fn() under no_grad (on CPU every wrapper goes through the dispatcher,
    which the profiler records; on CUDA the wrappers call the extension directly, so count on CPU)."""
    import collections

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("fuseinfer::"))


def assert_prefill_op_counts(model, ids, per_layer: dict, once: dict | None = None) -> None:
    """``fuseinfer.prefill(model, ids)`` calls each op of ``per_layer`` (name without ``fuseinfer::`` -> calls per
    decoder layer) that many times per layer, and each of ``once`` that many times in all (counted on CPU)."""
    import fuseinfer

    counts = fuseinfer_op_counts(lambda: fuseinfer.prefill(model, ids))
    layers = model.config.num_hidden_layers
    want = {**{op: n * layers for op, n in per_layer.items()}, **(once or {})}
    got = {op: counts[f"fuseinfer::{op}"] for op in want}
    assert got == want, (got, want)


def modules_forward(model, **inputs):
    """model(**inputs) through the patched modules, under no_grad (RuntimeConfig.prefill='module' for the call: the
    patched model's own forward otherwise takes the lean loop, runtime/forward.py)."""
    import fuseinfer

    with fuseinfer.runtime.using_runtime(model, prefill="module"), torch.no_grad():
        return model(**inputs)


def cache_run(fn, model, ids, slots: int = 64):
    """fn(model, ids, positions, cache, q_start) over a fresh static KV cache of ``slots`` slots on the model's device
    (a prefill into slots [0, S)): (its logits, the last layer's keys and values of those slots)."""
    from fuseinfer.runtime.cache import StaticKVCache

    cfg, p = model.config, next(model.parameters())
    heads = cfg.num_attention_heads
    cache = StaticKVCache(cfg.num_hidden_layers, ids.shape[0], heads, cfg.hidden_size // heads, slots, p.dtype,
                          p.device)
    cache.key_mask[:] = True
    cache.write_idx = torch.arange(ids.shape[1], device=p.device)
    pos = torch.arange(ids.shape[1], device=p.device).expand(ids.shape)
    q_start = torch.zeros(ids.shape[0], dtype=torch.int32, device=p.device)
    with torch.no_grad():
        logits = fn(model, ids, pos, cache, q_start)
    return logits, cache.keys[-1][:, :, :ids.shape[1]].clone(), cache.values[-1][:, :, :ids.shape[1]].clone()


def assert_lean_equals_modules(model, ids, gemm_op: str, per_layer: int = 4):
    """The lean prefill loop takes ``model`` and gives its patched modules' logits and cache contents bit for bit
    (on CPU), with the same fuseinfer ops (``gemm_op`` ``per_layer`` times per layer; the LM head on the last
    position only)."""
    from fuseinfer import prefill
    from fuseinfer.models.opt.decode import forward_last_logits
    from fuseinfer.runtime import prefill as pf

    assert pf.lean_reason(model) is None
    ours, ref = cache_run(pf.lean_logits, model, ids), cache_run(forward_last_logits, model, ids)
    for a, b in zip(ours, ref):  # logits, last layer's keys and values
        assert torch.equal(a, b)
    lean = fuseinfer_op_counts(lambda: prefill(model, ids))
    mods = fuseinfer_op_counts(lambda: modules_forward(model, input_ids=ids))
    assert lean == mods and lean[gemm_op] == per_layer * model.config.num_hidden_layers


def assert_same_tokens_lean_and_modules(model, ids):
    """fuseinfer.generate chooses the same tokens with the lean prefill and with the modules
    (RuntimeConfig.prefill)."""
    import fuseinfer

    lean = fuseinfer.generate(model, ids, max_new_tokens=6)
    with fuseinfer.runtime.using_runtime(model, prefill="module"):
        assert torch.equal(fuseinfer.generate(model, ids, max_new_tokens=6), lean)


def assert_same_tokens_graph_lean_modules(model, ids, max_new_tokens: int = 8):
    """fuseinfer.generate chooses the same tokens with the prefill graph (captured by that choice only), the lean
    loop and the modules (RuntimeConfig.prefill graph / lean / module)."""
    import fuseinfer
    from fuseinfer.runtime.cache import COUNTS

    out = {}
    for choice in ("graph", "lean", "module"):
        fuseinfer.runtime.set_runtime(model, prefill=choice)  # (and fresh sessions)
        before = COUNTS["prefill_graph"]
        out[choice] = fuseinfer.generate(model, ids, max_new_tokens=max_new_tokens)
        assert (COUNTS["prefill_graph"] > before) == (choice == "graph")
    assert torch.equal(out["graph"], out["lean"]) and torch.equal(out["lean"], out["module"])


def with_fp8_caches(args: dict) -> dict:
    """A decode step's arguments (``k_caches``, ``v_caches`` of keys and values) over FP8 caches: each layer's (2, Hkv)
    scales from its caches as a prefill calibrates them (``kv_scales_from``), the caches quantized with them
    (float8_e4m3fn, fresh tensors) and ``kv_scales`` set; the other arguments shared."""
    from fuseinfer.ops.kv_cache import kv_scales_from, quantize_kv

    scales = [kv_scales_from(k, v) for k, v in zip(args["k_caches"], args["v_caches"])]
    return {**args, "kv_scales": scales,
            "k_caches": [quantize_kv(k, s[0]) for k, s in zip(args["k_caches"], scales)],
            "v_caches": [quantize_kv(v, s[1]) for v, s in zip(args["v_caches"], scales)]}


def assert_fp8_caches_within_rule(ours: torch.Tensor, torch_lowp: torch.Tensor, ref: torch.Tensor,
                                  scale: torch.Tensor, what: str = "") -> None:
    """float8_e4m3fn caches (B, Hkv, T, D) with their (2, Hkv) ``scale`` row (keys' or values'), dequantized: ours
    within twice the reference run in the low dtype's error against the higher-precision reference, plus one e4m3 step
    of each value. The step: a value the two compute a hair apart (another rounding of an activation) that sits on an
    e4m3 rounding boundary is stored one step apart, whatever the rule says of the values before rounding."""
    s = scale.float().view(1, -1, 1, 1)
    o, t, r = (x.float() * s for x in (ours, torch_lowp, ref))
    mag = (r / s).abs()  # in e4m3 units: steps of 2^(e - 3) for normals (e = floor(log2)), 2^-9 below 2^-6
    step = torch.where(mag >= 2.0 ** -6, torch.exp2(torch.floor(torch.log2(mag.clamp_min(2.0 ** -6))) - 3), 2.0 ** -9)
    bound = 2 * (t - r).abs().max() + step * s + 1e-6
    bad = (o - r).abs() > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} values beyond the rule, worst {(o - r).abs().max().item():.3g} "
                           f"(torch {(t - r).abs().max().item():.3g})")


def step_args_in(args: dict, dtype: torch.dtype) -> dict:
    """A copy of a one-kernel decode step's arguments (``opt_decode_step`` / ``llama_decode_step``) with floating
    tensors in ``dtype`` (caches copied, never shared; int8 weights stay int8, FP8 caches float8_e4m3fn with their
    fp32 scales)."""
    conv = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    cache = lambda c: c.clone() if c.dtype == torch.float8_e4m3fn else c.to(dtype, copy=True)  # noqa: E731
    out = {k: (conv(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    for name in ("layer_params", "qkv_biases"):  # (Llama's q/k/v biases have a list of their own)
        if name in args:
            out[name] = [conv(p) for p in args[name]]
    out["k_caches"] = [cache(c) for c in args["k_caches"]]
    out["v_caches"] = [cache(c) for c in args["v_caches"]]
    return out


def assert_step_within_rule(step, ref, args: dict, dtype) -> torch.Tensor:
    """A one-kernel decode step's logits and caches (``step(**args)``, which updates ``args``' caches) within twice
    its reference's (``ref``) own error in ``dtype`` against the fp32 reference on the same inputs, weights and
    scales; returns the step's logits. FP8 caches: the fp32 reference rounds the new keys and values to ``dtype``
    before quantizing them, as the per-op path and the kernel store the projection (else an e4m3 rounding boundary
    between the two values would count as the kernel's error), and the dequantized caches are within the rule plus
    one e4m3 step (:func:`assert_fp8_caches_within_rule`)."""
    fp8 = bool(args.get("kv_scales"))
    ref_args, lowp_args = step_args_in(args, torch.float32), step_args_in(args, dtype)
    ref32 = ref(**ref_args, kv_round=dtype if fp8 else None)
    torch_lowp = ref(**lowp_args)
    ours = step(**args)
    assert ours.shape == ref32.shape and ours.dtype == torch.float32
    # (+ half a unit in the last place of dtype at the largest logit: the step rounds its logits to dtype, as the LM
    # head does, and with a small vocabulary the reference's few logits may all round closer than one of ours)
    err, torch_err = (ours - ref32).abs().max().item(), (torch_lowp - ref32).abs().max().item()
    assert err <= 2 * torch_err + lowp_atol(ref32, dtype), f"logits: ours {err:.3g} vs torch {torch_err:.3g}"
    # (the keys' scale row of every layer, then the values')
    scales = iter([sc[0] for sc in args.get("kv_scales") or []] + [sc[1] for sc in args.get("kv_scales") or []])
    for ours_c, ref_c, lowp_c in zip(args["k_caches"] + args["v_caches"], ref_args["k_caches"] + ref_args["v_caches"],
                                     lowp_args["k_caches"] + lowp_args["v_caches"]):
        if fp8:
            assert_fp8_caches_within_rule(ours_c, lowp_c, ref_c, next(scales), "cache")
            continue
        e, te = (ours_c.float() - ref_c).abs().max().item(), (lowp_c.float() - ref_c).abs().max().item()
        assert e <= 2 * te + lowp_atol(ref_c, dtype), f"cache: ours {e:.3g} vs torch {te:.3g}"
    return ours


def assert_fp8_step(step, ref, args: dict, dtype, q_start) -> None:
    """A one-kernel decode step over FP8 caches (``args`` from :func:`with_fp8_caches`): within the rule of
    :func:`assert_step_within_rule`, repeated launches equal (the launch counters, attention counters and tagged
    buffers carry over between launches), and the value scales read: doubled, they double the cached values' share
    of the attention's output, which moves the logits. Not on a first token (every ``q_start`` 0): every value it
    attends to is its own, stored with the doubled scale and read back with it, so the output stays the same (a
    power-of-two scale changes no e4m3 code's value)."""
    fresh = {**args, "k_caches": [c.clone() for c in args["k_caches"]],
             "v_caches": [c.clone() for c in args["v_caches"]]}
    ours = assert_step_within_rule(step, ref, args, dtype)
    for _ in range(3):
        assert torch.equal(step(**args), ours)
    if max(q_start) > 0:
        doubled = step(**{**fresh, "kv_scales": [s * torch.tensor([[1.0], [2.0]], device=s.device)
                                                  for s in fresh["kv_scales"]]})
        assert not torch.allclose(doubled, ours, rtol=1e-3, atol=1e-3)


def generate_decode_kernel_off_on(model_path, dtype: torch.dtype, expect_on: str, pad: bool = False,
                                  **runtime) -> dict:
    """``fuseinfer.generate``'s greedy tokens (32 new) on the checkpoint at ``model_path`` (``dtype``, CUDA) patched
    with ``RuntimeConfig(decode_kernel="off")`` and then ``"on"`` (and ``runtime``'s other settings), each for five
    40-token prompts (two left-padded; ``pad``: their padding set to the pad token) and for the first alone:
    {kernel: (the batch's tokens, the first's)}. Each run's batch buckets 1 and 8 must take the kernel's path:
    ``expect_on`` for "on" (the start of the session's path), per op for "off"."""
    from transformers import AutoModelForCausalLM

    import fuseinfer
    from fuseinfer.runtime.decode import SESSIONS_ATTR

    ids = torch.randint(3, 4000, (5, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = mask[3, :20] = 0
    out = {}
    for kernel in ("off", "on"):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).cuda().eval()
        ids = ids.clamp(max=model.config.vocab_size - 1)
        if pad:
            ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
        config = fuseinfer.RuntimeConfig(decode_kernel=kernel, **runtime)
        fuseinfer.patch(model, fuseinfer.PatchConfig(runtime=config))
        out[kernel] = (fuseinfer.generate(model, ids, mask, max_new_tokens=32),
                       fuseinfer.generate(model, ids[:1], max_new_tokens=32))
        sessions = model.__dict__[SESSIONS_ATTR]
        for bucket in (1, 8):
            if runtime.get("kv_cache") == "fp8":
                assert sessions[bucket].cache.kv_scales is not None
            expect = expect_on if kernel == "on" else "per op"
            assert sessions[bucket].path.startswith(expect), (kernel, bucket, sessions[bucket].path)
    return out


def assert_fp8_cache_tokens_agree(out: dict, prompt: int) -> None:
    """The FP8-cache tokens of :func:`generate_decode_kernel_off_on` ("on" against "off"): the first four new tokens
    equal, the rest at least 90%. Where the two paths' projections differ in their last bit (another accumulation
    order), a value on an e4m3 rounding boundary is stored one step apart, and a near tie can turn."""
    for ours, theirs in ((out["on"][0], out["off"][0]), (out["on"][1], out["off"][1])):
        assert torch.equal(ours[:, :prompt + 4], theirs[:, :prompt + 4])
        assert (ours[:, prompt:] == theirs[:, prompt:]).float().mean().item() >= 0.9


# ---- the folded-norm model tests (tests/models/*/test_fold_norms.py) ----

def load_causal_lm(path, dtype, device="cpu"):
    """A checkpoint's AutoModelForCausalLM in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def fold_ids(model, rows=3, length=20, seed=6, device="cpu"):
    """(input_ids, attention_mask) of random tokens, the first row left-padded by 5."""
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    return ids.to(device), mask.to(device)


def run_folded(model, ids, mask, family_modules, fold: bool, monkeypatch, config=None):
    """(greedy tokens, one cached decode step's logits) with ``family_modules.FOLD_NORMS = fold``, through a fresh
    patch (``config``: its PatchConfig, or the default)."""
    import fuseinfer

    monkeypatch.setattr(family_modules, "FOLD_NORMS", fold)
    monkeypatch.setattr(family_modules, "FOLD_MAX_ROWS", 16)  # (every decode row count)
    fuseinfer.patch(model, config)
    try:
        tokens = fuseinfer.generate(model, ids, mask, max_new_tokens=12, min_new_tokens=12, pad_token_id=1)
        with torch.no_grad():  # one cached decode step through the patched modules
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            step = model(input_ids=tokens[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                         past_key_values=out.past_key_values).logits
    finally:
        fuseinfer.unpatch(model)
    return tokens, step


def folded_op_counts(model, ids, mask, family_modules, monkeypatch, config=None) -> dict:
    """{fold: Counter of fuseinfer::* op calls} of a 3-token greedy generate with ``family_modules.FOLD_NORMS`` off
    and on (CPU: every op call goes through the dispatcher)."""
    import fuseinfer

    counts = {}
    for fold in (False, True):
        monkeypatch.setattr(family_modules, "FOLD_NORMS", fold)
        monkeypatch.setattr(family_modules, "FOLD_MAX_ROWS", 16)  # (every decode row count)
        fuseinfer.patch(model, config)
        try:
            counts[fold] = fuseinfer_op_counts(
                lambda: fuseinfer.generate(model, ids, mask, max_new_tokens=3, min_new_tokens=3, pad_token_id=1))
        finally:
            fuseinfer.unpatch(model)
    return counts


def folded_norm_kernels(model, family_modules, norm_kernel: str, monkeypatch, quant=None) -> tuple[dict, dict]:
    """({fold: norm kernels a decode step}, {fold: 3 greedy tokens}) of per-op decode steps (no CUDA graphs, so the
    profiler sees each kernel; the one-kernel step off) of 2 rows with ``family_modules.FOLD_NORMS`` off and on;
    ``norm_kernel``: a word of the norm kernel's name."""
    import fuseinfer

    ids, mask = fold_ids(model, rows=2, device="cuda")
    runtime = fuseinfer.RuntimeConfig(cuda_graphs=False, decode_kernel="off")
    config = fuseinfer.PatchConfig(runtime=runtime, quant=quant)
    norms, tokens = {}, {}
    for fold in (False, True):
        monkeypatch.setattr(family_modules, "FOLD_NORMS", fold)
        monkeypatch.setattr(family_modules, "FOLD_MAX_ROWS", 16)  # (every decode row count)
        fuseinfer.patch(model, config)
        try:
            def gen(n):
                return fuseinfer.generate(model, ids, mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=1)

            gen(3)  # warm-up
            counts = [sum(norm_kernel in k for k in cuda_kernel_names(lambda: gen(n))) for n in (1, 3)]  # noqa: B023
            tokens[fold] = gen(3)
        finally:
            fuseinfer.unpatch(model)
        norms[fold] = (counts[1] - counts[0]) // 2  # two decode steps
    return norms, tokens


def assert_folded_ops_ran(counts: dict, folded_ops: tuple[str, str], norm_op: str, layers: int):
    """``folded_op_counts``' counts: with the fold both folded ops (q/k/v and the MLP's first GEMV) ran at least
    twice per layer and the norm op that many times less; without it, never."""
    on, off = counts[True], counts[False]
    for op in folded_ops:
        assert on[op] >= 2 * layers, on
        assert off[op] == 0, off
    assert off[norm_op] - on[norm_op] == sum(on[op] for op in folded_ops), (on, off)


def hooked_module_inputs(model, family_modules, module, monkeypatch, pre_hook: bool) -> dict:
    """{fold: the rows ``module`` (patched, hooked after the patch) received} of one forward with
    ``family_modules.FOLD_NORMS`` off and on: a forward pre-hook (``pre_hook``) or forward hook."""
    import fuseinfer

    ids, mask = fold_ids(model, rows=1, length=6)
    seen = {}
    for fold in (False, True):
        monkeypatch.setattr(family_modules, "FOLD_NORMS", fold)
        monkeypatch.setattr(family_modules, "FOLD_MAX_ROWS", 16)  # (every decode row count)
        fuseinfer.patch(model)
        target = module(model)
        if pre_hook:
            handle = target.register_forward_pre_hook(
                lambda m, args, kwargs: seen.__setitem__(  # noqa: B023
                    fold, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        else:
            handle = target.register_forward_hook(lambda m, args, out: seen.__setitem__(fold, args[0]))  # noqa: B023
        try:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
        finally:
            handle.remove()
            fuseinfer.unpatch(model)
    return seen


# ---- the tiny trained OPT's WikiText-2 perplexity (tests/quant) ----

PPL_SEQ_LEN, PPL_WINDOWS = 2048, 2  # GPTQ protocol windows of the tiny model's full context, a few to stay fast


def needs_wikitext():
    """Skip (visibly) where the shared WikiText-2 raw files are absent."""
    from conftest import WIKITEXT

    from fuseinfer.quant import smoothquant as sq

    if not (WIKITEXT / "wiki.test.raw").is_file() or not (WIKITEXT / sq.CALIBRATION_FILE).is_file():
        pytest.skip(f"WikiText-2 raw files not found in {WIKITEXT}; set FUSEINFER_SHARED")


def wikitext_ppl(model, windows, device):
    """The model's perplexity over ``windows`` (wikitext_windows)."""
    from fuseinfer.harness.perplexity import perplexity

    with torch.no_grad():
        return perplexity(lambda i, l: model(input_ids=i, labels=l).loss, windows, device).ppl


def wikitext_windows(tok):
    """The first PPL_WINDOWS GPTQ-protocol windows of PPL_SEQ_LEN tokens of wiki.test.raw."""
    from conftest import WIKITEXT

    from fuseinfer.harness.data import load_eval_text, tokenize
    from fuseinfer.harness.perplexity import gptq_windows

    return gptq_windows(tokenize(tok, load_eval_text(str(WIKITEXT)).text), PPL_SEQ_LEN, PPL_WINDOWS)


def tiny_opt_and_tokenizer(path, dtype=torch.float32, device="cpu"):
    """The tiny trained OPT at ``path`` in ``dtype`` on ``device`` (eval mode) and its tokenizer."""
    from transformers import AutoTokenizer, OPTForCausalLM

    needs_wikitext()
    tok = AutoTokenizer.from_pretrained(path)
    return OPTForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), tok


def assert_out_proj_takes_8bit_attention(model, out_proj, fmt: str):
    """out_proj (a linear with a static input scale) on the attention's 8-bit output (``attention_8bit_ref`` in
    ``fmt``, its scale) equals its own call on the fp32 attention output, which quantizes with that scale."""
    from fuseinfer.ops.attention import attention_ref
    from fuseinfer.ops.attention_8bit_out import attention_8bit_ref

    g = torch.Generator().manual_seed(0)
    heads, d = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    q, k, v = (torch.randn(2, heads, 9, d, generator=g) for _ in range(3))  # (B, H, S, D)
    y = attention_8bit_ref(q, k, v, None, None, 0.3, out_proj.input_scale, fmt).flatten(2)  # (2, 9, E) 8-bit
    a = attention_ref(q, k, v, None, None, 0.3).flatten(2)  # (2, 9, E) fp32
    ref = out_proj.forward_quantized(y, out_proj.static_scales(y), None, "none", torch.float32)
    assert torch.equal(out_proj.fused(a), ref)


def assert_graph_follows_scale(call, scale: torch.Tensor, values=(0.05, 0.2)) -> None:
    """``call(scale)`` (an op writing 8 bits with the static scale ``scale``, one fp32 value on the GPU), captured once
    in a CUDA graph, follows in-place changes of the scale (read on the device, no host sync): each replay equals an
    eager call at that value, bit for bit."""
    call(scale)  # (warm-up outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(scale)
    for value in values:
        scale.fill_(value)
        graph.replay()
        assert torch.equal(out.view(torch.uint8), call(scale).view(torch.uint8)), value


def scaled_linear_operands(quantize, lead, n, k, bias_dtype=torch.float16, seed=0, device="cpu"):
    """(x_q, x_scale, w_q, w_scale, bias) of an 8-bit scaled linear: x (*lead, K) quantized per token and w (N, K)
    per output channel by ``quantize(t, dim)`` (quantize_int8_ref / quantize_fp8_ref), bias (N,) in bias_dtype or
    None; seeded, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    b = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    x_q, x_s = quantize(x, -1)
    w_q, w_s = quantize(w, -1)
    return tuple(None if t is None else t.to(device) for t in (x_q, x_s, w_q, w_s, b))


# ---- the benchmark scripts (tests/bench) ----

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def assert_bench_requires_out(script: str) -> None:
    """``python bench/<script>.py`` without arguments stops with a usage error naming ``--out``."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(BENCH_DIR / f"{script}.py")], capture_output=True, text=True)
    assert out.returncode == 2 and "--out" in out.stderr


# ---- op wrappers' argument checks (tests/ops) ----

def assert_rejects_each(op, args, replacements, match: str | None = None) -> None:
    """``op(*args)`` with args[i] replaced by each (i, value) of ``replacements`` raises one FuseInferError (whose
    message matches ``match`` when given)."""
    from fuseinfer import FuseInferError

    for i, value in replacements:
        wrong = list(args)
        wrong[i] = value
        with pytest.raises(FuseInferError, match=match):
            op(*wrong)
