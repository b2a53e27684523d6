"""The Llama family's lean prefill loop (fuseinfer/models/llama/lean.py) on CPU, fp32: over fuseinfer's static cache
it computes what the decode forward (the patched modules) computes, bit for bit, logits and cache contents; without
a cache ``fuseinfer.prefill`` gives the patched and the unpatched model's last logits with left padding; fast decode
after it chooses transformers' greedy tokens; ``lean_hidden`` gives the base model's last hidden state and
transformers' DynamicCache keys / values; int8 weight-only (W8A16) models; every rope type the patch takes
(dynamic rope refused) and the refusals (hooks, training mode, a module swapped in, unlinked weights, partial patch).
The GPU half (fp16 / bf16 through the kernels, and the prefill graphs) is at the end, marked ``gpu``."""
from __future__ import annotations

import pytest
import torch
from conftest import random_llama

import fuseinfer
from fuseinfer import FuseInferError, Int8WeightOnly, PatchConfig, RuntimeConfig, models
from fuseinfer.models.llama import lean
from fuseinfer.models.llama.decode import forward_last_logits
from fuseinfer.runtime import prefill as pf
from fuseinfer.runtime.cache import StaticKVCache

ATOL32 = 2e-5  # fp32: the fused q/k/v and gate/up GEMMs sum in another order than three / two GEMMs

# name -> (model_type, config overrides): grouped-query 4/2 and 8/2, multi-head, Llama's biases, Qwen2's q/k/v
# biases, and the rope scalings whose tables depend on the positions only
KINDS = {
    "llama-4/2": ("llama", {}),
    "llama-8/2-bias": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                                     mlp_bias=True)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "mistral-4/2": ("mistral", {}),
    "qwen2-4/2": ("qwen2", {}),
    "llama3-rope": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=64))),
    "linear-rope": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "yarn-rope": ("qwen2", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0,
                                                     original_max_position_embeddings=128))),
}


def _model(kind):
    model_type, overrides = KINDS[kind]
    return random_llama(model_type, **overrides)


def _batch(vocab=512, rows=3, length=21, seed=1):
    """Left-padded ids and mask (B, S): row 1 has 5 pads, the last row all but one token padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[-1, :length - 1] = 0
    return ids, mask


def _positions(mask):
    return mask.long().cumsum(1) * mask - 1  # (B, S): what fast decode and fuseinfer.prefill pass


def _over_cache(fn, model, ids, mask):
    """fn(model, ids, positions, cache, q_start) over a fresh static cache of S + 16 slots, slots [0, S):
    (logits (B, V), every layer's keys and values of those slots)."""
    cfg, p = model.config, next(model.parameters())
    kv_heads, head_dim = models.family_of(model).kv_layout(cfg)
    cache = StaticKVCache(cfg.num_hidden_layers, ids.shape[0], kv_heads, head_dim, ids.shape[1] + 16, p.dtype,
                          p.device)
    cache.key_mask[:, :ids.shape[1]] = mask.bool()
    cache.key_mask[:, ids.shape[1]:] = True
    cache.write_idx = torch.arange(ids.shape[1], device=p.device)
    q_start = torch.zeros(ids.shape[0], dtype=torch.int32, device=p.device)
    with torch.no_grad():
        logits = fn(model, ids, _positions(mask), cache, q_start)
    s = ids.shape[1]
    return logits, [k[:, :, :s].clone() for k in cache.keys], [v[:, :, :s].clone() for v in cache.values]


def _assert_lean_equals_decode_forward(model, ids, mask):
    assert pf.lean_reason(model) is None
    ours, ref = _over_cache(pf.lean_logits, model, ids, mask), _over_cache(forward_last_logits, model, ids, mask)
    assert torch.equal(ours[0], ref[0])
    for a, b in zip(ours[1] + ours[2], ref[1] + ref[2]):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return lambda: AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()


def _count_lean(monkeypatch) -> list:
    """Records each call of the Llama lean loop (the family's lean_logits reaches it through the module)."""
    calls = []
    real = lean.lean_logits
    monkeypatch.setattr(lean, "lean_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# ---- the lean loop computes what the patched modules compute ----

@pytest.mark.parametrize("kind", list(KINDS))
def test_lean_loop_equals_the_decode_forward_over_the_cache(kind):
    """Same ops in the same order as forward_last_logits (the patched modules fast decode's prefill runs without
    the lean loop): the same logits and the same k/v in every layer's cache, bit for bit on CPU."""
    model = _model(kind)
    fuseinfer.patch(model)
    _assert_lean_equals_decode_forward(model, *_batch())


def test_lean_loop_equals_the_decode_forward_tiny_model(tiny):
    model = tiny()
    fuseinfer.patch(model)
    _assert_lean_equals_decode_forward(model, *_batch(vocab=model.config.vocab_size, rows=2, length=33))


@pytest.mark.parametrize("kind", ["llama-4/2", "llama-8/2-bias", "mistral-4/2", "qwen2-4/2", "llama3-rope"])
@pytest.mark.parametrize("padded", [False, True])
def test_fuseinfer_prefill_takes_the_lean_loop_and_equals_the_model(kind, padded, monkeypatch):
    """fuseinfer.prefill runs the lean loop, and gives the patched model's last logits (same positions) and the
    unpatched model's within fp32 tolerance."""
    model = _model(kind)
    ids, mask = _batch()
    if not padded:
        mask = torch.ones_like(ids)
    with torch.no_grad():
        unpatched = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]
    fuseinfer.patch(model)
    with torch.no_grad():
        patched = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]
    calls = _count_lean(monkeypatch)
    ours = fuseinfer.prefill(model, ids, mask if padded else None)
    assert calls == [1]
    assert ours.dtype == torch.float32 and ours.shape == (ids.shape[0], model.config.vocab_size)
    torch.testing.assert_close(ours, patched, rtol=1e-5, atol=1e-5)  # (the LM head over one row per sequence)
    torch.testing.assert_close(ours, unpatched, rtol=0, atol=ATOL32)


def test_logits_at_a_chosen_position():
    """``last``: the logits of that position (what the prefill graphs ask for: the prompt's end before padding)."""
    model = _model("qwen2-4/2")
    fuseinfer.patch(model)
    ids, mask = _batch()
    mask = torch.ones_like(ids)
    fam = models.family_of(model)
    with torch.no_grad():
        full = model(input_ids=ids).logits
    for k in (0, 7, ids.shape[1] - 1):
        ours = fam.lean_logits(model, ids, _positions(mask), last=torch.tensor([k]))
        torch.testing.assert_close(ours, full[:, k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama-4/2", "mistral-4/2", "qwen2-4/2"])
def test_fast_decode_after_the_lean_prefill_equals_transformers_greedy(kind, monkeypatch):
    """fuseinfer.generate prefills through the lean loop (RuntimeConfig prefill='auto' on CPU) and continues over
    the k/v it wrote: the tokens of transformers' greedy generate of the unpatched model, and of the
    patched-modules prefill."""
    model = _model(kind)
    ids, mask = _batch()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    fuseinfer.patch(model, PatchConfig(runtime=RuntimeConfig(prefill="module")))
    calls = _count_lean(monkeypatch)
    modules = fuseinfer.generate(model, ids, mask, max_new_tokens=12, pad_token_id=0)
    assert calls == [] and torch.equal(modules, ref)
    fuseinfer.runtime.set_runtime(model, prefill="auto")
    assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=12, pad_token_id=0), ref)
    assert calls == [1]


def test_fast_decode_of_the_tiny_model_through_the_lean_prefill(tiny, monkeypatch):
    model = tiny()
    ids, mask = _batch(vocab=model.config.vocab_size, rows=2, length=16, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1)
    fuseinfer.patch(model)
    calls = _count_lean(monkeypatch)
    assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=20, pad_token_id=1), ref)
    assert calls == [1]


# ---- lean_hidden ----

@pytest.mark.parametrize("kind", ["llama-4/2", "llama-8/2-bias", "mistral-4/2", "qwen2-4/2", "yarn-rope"])
@pytest.mark.parametrize("padded", [False, True])
def test_lean_hidden_equals_the_base_model_and_its_dynamic_cache(kind, padded):
    """lean_hidden == the base model's last_hidden_state (after the final RMSNorm), and each layer's (k, v) ==
    transformers' DynamicCache's: bit for bit against the patched model, within fp32 tolerance against the
    unpatched one (at the real positions: padded queries attend no key, which implementations resolve their own
    way)."""
    model = _model(kind)
    ids, mask = _batch()
    if not padded:
        mask = torch.ones_like(ids)
    pos = _positions(mask) if padded else torch.arange(ids.shape[1]).expand(ids.shape)
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    with torch.no_grad():
        ref = model.model(**kwargs)
    fuseinfer.patch(model)
    with torch.no_grad():
        patched = model.model(**kwargs)
    fam = models.family_of(model)
    assert fam.prefill_reason(model) is None
    kv = []
    ours = fam.lean_hidden(model, ids, pos, mask.bool() if padded else None, kv_out=kv)
    cfg = model.config
    assert ours.shape == (*ids.shape, cfg.hidden_size) and ours.dtype == torch.float32
    assert len(kv) == cfg.num_hidden_layers
    real = mask.bool()
    assert torch.equal(ours, patched.last_hidden_state)
    torch.testing.assert_close(ours[real], ref.last_hidden_state[real], rtol=0, atol=ATOL32)
    for i, (k, v) in enumerate(kv):
        assert k.shape == v.shape == (ids.shape[0], *fam.kv_layout(cfg)[:1], ids.shape[1], fam.kv_layout(cfg)[1])
        layer, ref_layer = patched.past_key_values.layers[i], ref.past_key_values.layers[i]
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
        for ours_t, ref_t in ((k, ref_layer.keys), (v, ref_layer.values)):
            torch.testing.assert_close(ours_t.transpose(1, 2)[real], ref_t.transpose(1, 2)[real], rtol=0,
                                       atol=ATOL32)
    assert fam.lean_hidden(model, ids, pos, mask.bool() if padded else None).shape == ours.shape  # kv_out=None


# ---- W8A16 ----

@pytest.mark.parametrize("kind", ["llama-4/2", "qwen2-4/2"])
@pytest.mark.parametrize("head", [False, True], ids=["fp_head", "int8_head"])
def test_int8_weight_only_models_take_the_lean_loop(kind, head, monkeypatch):
    """Int8WeightOnly (q/k/v and gate/up quantized fused, Qwen2's q/k/v bias a buffer; with include_lm_head the
    LM head too): the lean loop equals the decode forward bit for bit, fuseinfer.prefill the patched model, and
    fast decode gives the tokens of the patched-modules prefill."""
    model = _model(kind)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(include_lm_head=head)))
    ids, mask = _batch()
    _assert_lean_equals_decode_forward(model, ids, mask)
    with torch.no_grad():
        patched = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]
    calls = _count_lean(monkeypatch)
    torch.testing.assert_close(fuseinfer.prefill(model, ids, mask), patched, rtol=1e-5, atol=1e-5)
    assert calls == [1]
    lean_tokens = fuseinfer.generate(model, ids, mask, max_new_tokens=8, pad_token_id=0)
    with fuseinfer.runtime.using_runtime(model, prefill="module"):
        assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=8, pad_token_id=0), lean_tokens)
    assert calls == [1, 1]


# ---- refusals: the patched modules run where the lean loop would compute something else ----

def test_refusals_and_the_patched_forward_serving_them():
    """Unpatched, training mode, hooks on a module the patched forward calls (a layer, the rotary module, the final
    norm), a q/k/v weight unlinked by ``param.data = t``, a linear or an attention module swapped in after patch,
    a layer appended, a partial patch: prefill_reason says why, lean_logits refuses an unpatched model, and
    fuseinfer.prefill still returns the patched forward's logits (the hook ran)."""
    ids, mask = _batch()
    model = _model("llama-4/2")
    fam = models.family_of(model)
    assert "patch" in fam.prefill_reason(model)
    with pytest.raises(FuseInferError, match="patch"):
        fam.lean_logits(model, ids, _positions(mask))
    fuseinfer.patch(model)
    assert fam.prefill_reason(model) is None
    base = model.model

    def patched_logits():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]

    for module in (base.layers[1], base.rotary_emb, base.norm, base.layers[0].mlp):
        seen = []
        handle = module.register_forward_hook(lambda *a: seen.append(1))
        assert "hooks" in fam.prefill_reason(model)
        ref = patched_logits()
        seen.clear()
        torch.testing.assert_close(fuseinfer.prefill(model, ids, mask), ref, rtol=1e-5, atol=1e-5)
        assert seen == [1]  # the hook ran: the patched forward served the call
        handle.remove()
        assert fam.prefill_reason(model) is None
    model.train()
    assert "training" in fam.prefill_reason(model)
    model.eval()
    k = base.layers[0].self_attn.k_proj
    old = k.weight.data
    k.weight.data = old.clone() * 2
    assert "replaced" in fam.prefill_reason(model)
    assert fam.prefill_reason(model, weights=False) is None  # (the graphs' per-call check leaves weights out)
    torch.testing.assert_close(fuseinfer.prefill(model, ids, mask), patched_logits(), rtol=1e-5, atol=1e-5)
    fuseinfer.unpatch(model)
    assert "patch" in fam.prefill_reason(model)

    for swap in ("down_proj", "o_proj", "self_attn", "append"):
        model = _model("llama-4/2")
        fuseinfer.patch(model)
        assert fam.prefill_reason(model) is None  # (the plan: made by the first call)
        layer = model.model.layers[1]
        if swap == "down_proj":
            old = layer.mlp.down_proj
            layer.mlp.down_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        elif swap == "o_proj":
            old = layer.self_attn.o_proj
            layer.self_attn.o_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        elif swap == "self_attn":
            from transformers.models.llama.modeling_llama import LlamaAttention

            layer.self_attn = LlamaAttention(model.config, 1)  # an unpatched one
        else:
            import copy

            model.model.layers.append(copy.deepcopy(layer))
        assert "replaced" in fam.prefill_reason(model), swap
        if swap != "append":  # (the appended layer reads cache layer 1 again: the forward is not the point)
            torch.testing.assert_close(fuseinfer.prefill(model, ids, mask), patched_logits(), rtol=1e-5, atol=1e-5)

    partial = _model("llama-4/2")
    fuseinfer.patch(partial, PatchConfig(filter_fn=lambda m, name: "layers.0" not in name))
    assert "filter_fn" in fam.prefill_reason(partial)


def test_dynamic_rope_is_refused():
    """dynamic / longrope tables depend on the longest position seen (a host read per call): refused, and
    fuseinfer.prefill runs the patched forward."""
    model = random_llama("llama", rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    fuseinfer.patch(model)
    fam = models.family_of(model)
    assert "dynamic" in fam.prefill_reason(model)
    ids, mask = _batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]
    torch.testing.assert_close(fuseinfer.prefill(model, ids, mask), ref, rtol=1e-5, atol=1e-5)


def test_plan_follows_unpatch_and_deep_copy():
    import copy

    model = _model("qwen2-4/2")
    fuseinfer.patch(model)
    ids, mask = _batch()
    fuseinfer.prefill(model, ids, mask)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
        ref = twin(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]
    assert models.family_of(twin).prefill_reason(twin) is None
    torch.testing.assert_close(fuseinfer.prefill(twin, ids, mask), ref, rtol=1e-5, atol=1e-5)
    fuseinfer.unpatch(model)
    assert not any("prefill" in k for k in model.__dict__)


def test_direct_calls_pass_what_the_extension_takes(monkeypatch):
    """The loop's calls straight into the extension (CUDA), checked on CPU: a stand-in extension whose ops are the
    references with the raw ops' argument order, refusing non-contiguous tensors as the kernels do, gives the op
    wrappers' logits and cache contents bit for bit (bf16, head dim 64, grouped-query, Qwen2's biases; W8A16)."""
    from fuseinfer.ops.attention import attention_ref
    from fuseinfer.ops.kv_cache import kv_cache_append_ref
    from fuseinfer.ops.linear import linear_epilogue_ref
    from fuseinfer.ops.linear_rope import linear_rope_append_ref
    from fuseinfer.ops.rms_norm import add_rms_norm_ref
    from fuseinfer.ops.rope import qkv_rope_append_ref, qkv_rope_ref
    from fuseinfer.ops.silu_mul import silu_mul_ref
    from fuseinfer.ops.w8a16_linear import w8a16_linear_ref

    calls = []

    def raw(name, fn):
        def op(*args):
            for a in args:
                assert not isinstance(a, torch.Tensor) or a.is_contiguous(), f"{name}: a non-contiguous argument"
            calls.append(name)
            return fn(*args)
        return op

    class Kernels:
        add_rms_norm = staticmethod(raw("add_rms_norm", add_rms_norm_ref))
        linear_epilogue = staticmethod(raw("linear_epilogue", linear_epilogue_ref))
        qkv_rope = staticmethod(raw("qkv_rope", qkv_rope_ref))
        qkv_rope_append = staticmethod(raw("qkv_rope_append", qkv_rope_append_ref))
        linear_rope_append = staticmethod(raw("linear_rope_append", linear_rope_append_ref))
        silu_mul = staticmethod(raw("silu_mul", silu_mul_ref))
        attention = staticmethod(raw("attention", attention_ref))
        w8a16_linear = staticmethod(raw("w8a16_linear", w8a16_linear_ref))
        kv_cache_append = staticmethod(raw("kv_cache_append", kv_cache_append_ref))

    for quant in (None, Int8WeightOnly()):
        model = random_llama("qwen2", hidden_size=256, intermediate_size=320, dtype=torch.bfloat16)  # head dim 64
        fuseinfer.patch(model, PatchConfig(quant=quant))
        ids, mask = _batch()
        ref = _over_cache(pf.lean_logits, model, ids, mask)
        ref_hidden = models.family_of(model).lean_hidden(model, ids, _positions(mask), mask.bool())
        with monkeypatch.context() as m:
            m.setattr(lean, "_kernels", lambda like: Kernels())
            assert lean.LeanOps(next(model.parameters()), 4, 2, 64).direct
            calls.clear()
            ours = _over_cache(pf.lean_logits, model, ids, mask)
            hidden = models.family_of(model).lean_hidden(model, ids, _positions(mask), mask.bool())
        gemm = "w8a16_linear" if quant is not None else "linear_epilogue"
        # (two forwards: the loop over the cache, then lean_hidden's without one; q/k/v one linear_rope_append in
        # both)
        layers = model.config.num_hidden_layers
        assert calls.count(gemm) == 2 * 3 * layers and calls.count("linear_rope_append") == 2 * layers
        assert calls.count("qkv_rope_append") == calls.count("qkv_rope") == 0
        for a, b in zip([ours[0], *ours[1], *ours[2], hidden], [ref[0], *ref[1], *ref[2], ref_hidden]):
            assert torch.equal(a, b)


# ---- GPU: the lean loop straight into the kernels, and its prefill graphs ----

# Llama-3.2-1B's shapes (hidden 2048, 32 heads over 8 KV heads of dim 64, MLP 8192, vocab 128256, tied embeddings,
# llama3 rope), two layers
_1B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
           vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096, num_hidden_layers=2,
           rms_norm_eps=1e-5, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                   low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=8192))
_LOWP = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def _cuda_models(dtype, quant=None, model_type="llama", **overrides):
    """(fp32 reference, unpatched ``dtype``, patched ``dtype``) copies of one random 1B-shaped model on CUDA."""
    import copy

    m32 = random_llama(model_type, device="cuda", **{**_1B, **overrides})
    lowp = copy.deepcopy(m32).to(dtype)
    patched = copy.deepcopy(lowp)
    fuseinfer.patch(patched, PatchConfig(quant=quant))
    return m32, lowp, patched


def _cuda_batch(vocab, rows=3, length=200, seed=2):
    """Left-padded ids and mask on CUDA: row 1 (if any) has 17 pads, row 2 (if any) all but 50 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1:2, :17] = 0
    mask[2:3, :length - 50] = 0
    return ids.cuda(), mask.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _LOWP)
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_lean_prefill_and_hidden_within_the_low_precision_rule_on_cuda(dtype, model_type):
    """fuseinfer.prefill (the lean loop straight into the extension) and lean_hidden, left-padded: within the
    low-precision rule of the fp32 model, as the patched forward is; the lean loop over the cache gives the decode
    forward's logits and k/v (the same kernels on the same shapes); a user can capture fuseinfer.prefill."""
    from helpers import assert_lowp_close, require_kernel

    require_kernel()
    m32, lowp, model = _cuda_models(dtype, model_type=model_type)
    assert lean.LeanOps(next(model.parameters()), 32, 8, 64).direct  # (the extension's ops, not the wrappers)
    ids, mask = _cuda_batch(model.config.vocab_size)
    pos = _positions(mask)
    real = mask.bool()
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=pos)
    with torch.no_grad():
        ref32, torch_lowp, patched = (m(**kwargs).logits[:, -1].float() for m in (m32, lowp, model))
        hidden32, hidden_lowp = (m.model(**kwargs).last_hidden_state[real] for m in (m32, lowp))
    fam = models.family_of(model)
    assert fam.prefill_reason(model) is None
    ours = fuseinfer.prefill(model, ids, mask)
    assert_lowp_close(ours, torch_lowp, ref32, f"{dtype} lean prefill", atol=1e-2)
    assert_lowp_close(patched, torch_lowp, ref32, f"{dtype} patched forward", atol=1e-2)
    hidden = fam.lean_hidden(model, ids, pos, real)
    assert hidden.dtype == dtype
    assert_lowp_close(hidden[real], hidden_lowp, hidden32, f"{dtype} lean_hidden", atol=1e-2)
    # over the static cache: what fast decode's prefill computes with the patched modules
    lean_out, ref_out = _over_cache(pf.lean_logits, model, ids, mask), _over_cache(forward_last_logits, model, ids,
                                                                                    mask)
    torch.testing.assert_close(lean_out[0], ref_out[0], rtol=1e-2, atol=1e-2)
    for a, b in zip(lean_out[1] + lean_out[2], ref_out[1] + ref_out[2]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fuseinfer.prefill(model, ids, mask)
    graph.replay()
    torch.testing.assert_close(static, ours, rtol=2e-3, atol=2e-3)  # (cuBLASLt takes its heuristic under capture)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _LOWP)
@pytest.mark.parametrize("prompt", [100, 300])
def test_prefill_graph_logits_on_cuda(dtype, prompt):
    """Fast decode's prefill through a bucket graph of the lean loop (right padding to the bucket): the first
    logits within the low-precision rule, replayed again by the next call, and the first token of the
    patched-modules prefill."""
    from helpers import assert_lowp_close, require_kernel

    from fuseinfer.runtime.decode import SESSIONS_ATTR

    require_kernel()
    m32, lowp, model = _cuda_models(dtype)
    ids, mask = _cuda_batch(model.config.vocab_size, rows=2, length=prompt)
    fuseinfer.runtime.set_runtime(model, prefill="module")
    ref = fuseinfer.generate(model, ids, mask, max_new_tokens=4)
    fuseinfer.runtime.set_runtime(model, prefill="graph")  # (and fresh sessions)
    ours = fuseinfer.generate(model, ids, mask, max_new_tokens=4)
    session = model.__dict__[SESSIONS_ATTR][2]
    assert list(pf.graph_stats(session)) == [pf.length_bucket(prompt)]
    assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=4), ours)  # replayed again
    # (later tokens may flip at a near-tie of random weights: the tiny model's are compared whole below)
    assert torch.equal(ours[:, :prompt + 1], ref[:, :prompt + 1])
    pos = _positions(mask)
    with torch.no_grad():
        ref32 = m32(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        torch_lowp = lowp(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
    graph = pf._graphs[session.cache][pf.length_bucket(prompt)]
    session.cache.key_mask.zero_()
    session.cache.key_mask[:, :prompt] = mask.bool()
    session.cache.key_mask[:, prompt:] = True
    session.q_start.zero_()
    logits = graph.run(ids, pos, session.pad).clone()
    assert_lowp_close(logits, torch_lowp, ref32, f"{dtype} prefill graph", atol=1e-2)


@pytest.mark.gpu
def test_int8_weight_only_lean_prefill_on_cuda():
    """W8A16 through the lean loop (w8a16_linear straight into the extension): as close to the fp32 model as the
    patched int8 modules are (the rule with the patched forward as the baseline)."""
    from helpers import assert_lowp_close, require_kernel

    require_kernel()
    m32, _, model = _cuda_models(torch.float16, quant=Int8WeightOnly())
    ids, mask = _cuda_batch(model.config.vocab_size)
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    with torch.no_grad():
        ref32, patched = (m(**kwargs).logits[:, -1].float() for m in (m32, model))
    assert models.family_of(model).prefill_reason(model) is None
    assert_lowp_close(fuseinfer.prefill(model, ids, mask), patched, ref32, "W8A16 lean prefill", atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _LOWP)
def test_tiny_model_tokens_equal_through_graph_lean_and_modules_on_cuda(tiny_llama_path, dtype):
    """The trained tiny model: fuseinfer.generate's greedy tokens are the same with the prefill graph, the lean
    loop and the patched modules, and the patched model.generate's with the lean prefill."""
    from helpers import assert_same_tokens_graph_lean_modules, require_kernel
    from transformers import AutoModelForCausalLM

    require_kernel()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=dtype).cuda().eval()
    ids, mask = _cuda_batch(model.config.vocab_size, rows=1, length=40, seed=5)
    fuseinfer.patch(model)
    assert_same_tokens_graph_lean_modules(model, ids, max_new_tokens=24)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=1)
    fuseinfer.runtime.set_runtime(model, prefill="module")
    ref = model.generate(ids, **kwargs)
    fuseinfer.runtime.set_runtime(model, prefill="lean")
    assert torch.equal(model.generate(ids, **kwargs), ref)
