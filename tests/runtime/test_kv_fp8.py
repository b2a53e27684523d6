"""RuntimeConfig(kv_cache='fp8') end to end: the static cache in e4m3 with per-(layer, key/value head) scales set at
the prefill, fast decode on it (on the CPU the per-op step; the one-kernel step over FP8 caches is tested in
tests/ops/test_decode_step.py and test_llama_decode_step.py), WikiText-2 perplexity through the
cache within 0.3% of the model-dtype cache on the tiny trained OPT and Llama (CPU, fp32), greedy tokens, the
config's validation and the paths that refuse the FP8 cache. On a GPU: fp16 models (graphs, the kernels)."""
from __future__ import annotations

import pytest
import torch
import transformers
from conftest import WIKITEXT

import fuseinfer
from fuseinfer import FuseInferError, PatchConfig, RuntimeConfig
from fuseinfer.core.state import patch_state
from fuseinfer.ops.kv_cache import FP8_DTYPE
from fuseinfer.runtime.cache import StaticKVCache
from fuseinfer.runtime.decode import SESSIONS_ATTR

WINDOW, PREFILL, CHUNK, WINDOWS = 512, 128, 64, 4  # tokens per window, its calibrating prefill, then chunks of


def _model(path, kv_cache: str, dtype=torch.float32, device="cpu", quant=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    fuseinfer.patch(model, PatchConfig(quant=quant, runtime=RuntimeConfig(kv_cache=kv_cache)))
    return model


def _paths(request):
    return request.getfixturevalue("tiny_model_path" if request.param == "opt" else "tiny_llama_path")


@pytest.fixture(params=["opt", "llama"])
def tiny_path(request):
    return _paths(request)


def _windows(path, n: int = WINDOWS) -> torch.Tensor:
    """(n, WINDOW) token ids of the WikiText-2 test split's start."""
    if not (WIKITEXT / "wiki.test.raw").exists():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT}")
    text = (WIKITEXT / "wiki.test.raw").read_text()[:20000 * n]
    ids = transformers.AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids[0]
    return ids[:n * WINDOW].view(n, WINDOW)


def _cache_nll(model, ids: torch.Tensor, kv_dtype) -> tuple[float, int]:
    """Summed next-token NLL of ids (B, S) run through a static cache as fast decode fills it: a calibrating
    prefill of PREFILL tokens, then CHUNK tokens at a time attending the cache (no calibration: decode's case)."""
    fam = patch_state(model).family
    forward, why = fam.decode_forward(model)
    assert why is None, why
    cfg, (kv_heads, head_dim) = model.config, fam.kv_layout(model.config)
    b, s = ids.shape
    dev = ids.device
    cache = StaticKVCache(cfg.num_hidden_layers, b, kv_heads, head_dim, s, next(model.parameters()).dtype, dev,
                          kv_dtype)
    cache.key_mask.fill_(True)
    total, count, start = 0.0, 0, 0
    for end in [PREFILL, *range(PREFILL + CHUNK, s + 1, CHUNK)]:
        cache.write_idx = torch.arange(start, end, device=dev)
        cache.calibrate = start == 0
        positions = torch.arange(start, end, device=dev).expand(b, -1)  # (B, n), 0-based (OPT adds its offset)
        logits = forward(model, ids[:, start:end], positions, cache,
                         torch.full((b,), start, dtype=torch.int32, device=dev), keep=end - start)  # (B, n, V)
        targets = ids[:, start + 1:end + 1]
        n = targets.shape[1]
        total += torch.nn.functional.cross_entropy(logits[:, :n].reshape(-1, logits.shape[-1]).float(),
                                                   targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
        start = end
    return total, count


def test_fp8_cache_perplexity_within_0p3_percent(tiny_path):
    model = _model(tiny_path, "fp8")
    ids = _windows(tiny_path)
    with torch.no_grad():
        nll = {kind: _cache_nll(model, ids, kind) for kind in (None, FP8_DTYPE)}
    ppl = {kind: torch.tensor(t / n).exp().item() for kind, (t, n) in nll.items()}
    change = ppl[FP8_DTYPE] / ppl[None] - 1
    print(f"{tiny_path.name} WikiText-2 PPL through the cache: model dtype {ppl[None]:.4f}, fp8 "
          f"{ppl[FP8_DTYPE]:.4f} ({100 * change:+.3f}%)")
    assert abs(change) < 0.003
    assert change != 0  # (the FP8 cache was used: e4m3 rounding moves the perplexity)


def test_the_cache_is_e4m3_and_calibrated_by_the_prefill(tiny_path):
    model = _model(tiny_path, "fp8")
    ids = _windows(tiny_path, 1)[:, :40]
    out = fuseinfer.generate(model, ids, max_new_tokens=5)
    session = model.__dict__[SESSIONS_ATTR][1]
    cache = session.cache
    assert all(t.dtype == FP8_DTYPE for t in cache.keys + cache.values) and not cache.calibrate
    assert session.path.startswith("per op"), session.path  # (CPU: the one-kernel step is CUDA's)
    for keys, values, scales in zip(cache.keys, cache.values, cache.kv_scales):  # (B, Hkv, T, D), (2, Hkv)
        assert scales.dtype == torch.float32 and (scales != 1).all()
        for i, x in enumerate((keys, values)):  # the prompt's largest value sits at FP8_MAX / FP8_HEADROOM
            top = x[:, :, :40].float().abs().amax(dim=(0, 2, 3))
            assert torch.allclose(top, torch.full_like(top, 112.0), rtol=0.07), (i, top)
    assert out.shape == (1, 45)


def test_greedy_tokens_mostly_equal_and_model_generate_agrees(tiny_path):
    ids = _windows(tiny_path, 1)[:, :64].repeat(3, 1)
    ids[1, :10] = 1  # (some padding: the mask below)
    ids[2] = _windows(tiny_path, 2)[1, :64]
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    outs = {}
    for kind in ("auto", "fp8"):
        model = _model(tiny_path, kind)
        outs[kind] = fuseinfer.generate(model, ids, mask, max_new_tokens=24)
        if kind == "fp8":
            assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                              pad_token_id=0), outs[kind])
    same = (outs["auto"][:, 64:] == outs["fp8"][:, 64:]).float().mean().item()
    assert same >= 0.9, same


def test_any_weight_scheme_int8_weights(tiny_path):
    """The cache is independent of the weights: int8 weight-only weights decode over it too."""
    ids = _windows(tiny_path, 2)[:, :48]
    outs = {kind: fuseinfer.generate(_model(tiny_path, kind, quant=fuseinfer.Int8WeightOnly()), ids,
                                     max_new_tokens=16) for kind in ("auto", "fp8")}
    assert (outs["auto"][:, 48:] == outs["fp8"][:, 48:]).float().mean().item() >= 0.9


@pytest.mark.parametrize("value", ["fp16", "FP8", "e4m3", None, 8, True])
def test_a_bad_kv_cache_value_is_one_clear_error(value):
    with pytest.raises(FuseInferError, match=r"RuntimeConfig.kv_cache must be one of auto, fp8, got"):
        RuntimeConfig(kv_cache=value)


def test_the_knob_sets_the_default(monkeypatch):
    monkeypatch.setenv("FUSEINFER_KV_CACHE", "fp8")
    assert RuntimeConfig().kv_cache == "fp8" and RuntimeConfig(kv_cache="auto").kv_cache == "auto"


def test_set_runtime_switches_the_cache(tiny_model_path):
    model = _model(tiny_model_path, "auto")
    ids = torch.tensor([[5, 6, 7, 8]])
    fuseinfer.generate(model, ids, max_new_tokens=3)
    assert model.__dict__[SESSIONS_ATTR][1].cache.keys[0].dtype == torch.float32
    fuseinfer.runtime.set_runtime(model, kv_cache="fp8")
    fuseinfer.generate(model, ids, max_new_tokens=3)
    assert model.__dict__[SESSIONS_ATTR][1].cache.keys[0].dtype == FP8_DTYPE


def test_beam_search_and_the_middle_path_refuse_it_clearly(tiny_model_path):
    model = _model(tiny_model_path, "fp8")
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(FuseInferError, match=r"beam search has no FP8 KV cache: set fuseinfer.runtime.set_runtime\(model, "
                                             r"kv_cache='auto'\)"):
        model.generate(input_ids=ids, max_new_tokens=3, num_beams=2, do_sample=False)
    with pytest.raises(FuseInferError, match="has no FP8 KV cache"):  # (sampling beams: transformers' loop)
        model.generate(input_ids=ids, max_new_tokens=3, num_beams=2, do_sample=True)


def test_a_split_or_tensor_parallel_model_refuses_it(tiny_model_path, monkeypatch):
    from fuseinfer.core.decode_plan import DecodePlan
    from fuseinfer.runtime import cache as cache_mod

    model = _model(tiny_model_path, "fp8")
    plan = DecodePlan(devices=(torch.device("cpu"),) * 4)
    with pytest.raises(FuseInferError, match="a tensor-parallel or split model needs kv_cache='auto'"):
        cache_mod.kv_cache(model, plan, 4, 1, 4, 64, 128, torch.float32, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_fp16_generate_with_the_fp8_cache(tiny_path, graphs):
    """fp16 on the GPU (the FP8 kernels, CUDA graphs or eager): tokens mostly those of the fp16 cache, the session
    per op, and the cache's prefill-calibrated scales as on the CPU."""
    from helpers import require_kernel

    require_kernel()
    ids = _windows(tiny_path, 4)[:, :100].cuda()
    outs = {}
    for kind in ("auto", "fp8"):
        model = _model(tiny_path, kind, torch.float16, "cuda")
        fuseinfer.runtime.set_runtime(model, cuda_graphs=graphs)
        outs[kind] = fuseinfer.generate(model, ids, max_new_tokens=32)
    same = (outs["auto"][:, 100:] == outs["fp8"][:, 100:]).float().mean().item()
    assert same >= 0.85, same


@pytest.mark.gpu
def test_gpu_fp16_perplexity_within_0p3_percent(tiny_path):
    from helpers import require_kernel

    require_kernel()
    model = _model(tiny_path, "fp8", torch.float16, "cuda")
    ids = _windows(tiny_path).cuda()
    with torch.no_grad():
        nll = {kind: _cache_nll(model, ids, kind) for kind in (None, FP8_DTYPE)}
    ppl = {kind: torch.tensor(t / n).exp().item() for kind, (t, n) in nll.items()}
    assert abs(ppl[FP8_DTYPE] / ppl[None] - 1) < 0.003, ppl


def test_attention_over_an_fp8_cache_without_its_scales_is_one_clear_error():
    from fuseinfer.layers.hf_attention import MaskInfo, fuseinfer_attention_forward

    module = torch.nn.Module().eval()
    module.layer_idx, module.config = 0, transformers.PretrainedConfig()
    q, k = torch.randn(1, 2, 1, 8), torch.zeros(1, 2, 4, 8, dtype=FP8_DTYPE)
    with pytest.raises(FuseInferError, match=r"read with its scales: pass the mask as MaskInfo\(key_mask, q_start, "
                                             r"kv_scales=cache.kv_scales\)"):
        fuseinfer_attention_forward(module, q, k, k, MaskInfo(None, None))
    scales = [torch.ones(2, 2)]
    out, _ = fuseinfer_attention_forward(module, q, k, k, MaskInfo(None, None, scales))
    assert out.shape == (1, 1, 2, 8) and out.eq(0).all()  # (zero keys and values)
