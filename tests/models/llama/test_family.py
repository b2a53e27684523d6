"""The Llama-architecture families (Llama, Mistral, Qwen2) through ``fuseinfer.patch`` on CPU: patched logits equal
the unpatched model's (fp32 and bf16; random Mistral and Qwen2 with q/k/v biases; grouped-query 4/2 and 8/2),
WikiText-2 perplexity within 0.1% of eager, greedy tokens of ``fuseinfer.generate`` and the patched
``model.generate`` equal transformers' with left padding, transformers' own caches, unpatch exact, save_pretrained
of a patched model reloads as the original, the sliding-window refusal, the engine's checks (filter_fn, hooks,
training mode), and every random: configuration on the meta device with its KV layout."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import WIKITEXT, random_llama
from helpers import assert_same_state, state, modules_forward

import fuseinfer
from fuseinfer import FuseInferError, PatchConfig
from fuseinfer import models
from fuseinfer.models.llama import modules as llama_modules

ATOL32 = 2e-5  # fp32 logits: the fused q/k/v and gate/up GEMMs sum in another order than three / two GEMMs


@pytest.fixture(scope="module")
def tiny_cpu(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return lambda dtype=torch.float32: AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=dtype).eval()


def _ids(model, rows=3, length=21, seed=0):
    return torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


def _left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[1, :2] = 0
    return mask


@torch.no_grad()
def _logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits.float()


def _assert_logits_close(ours, ref, mask, atol):
    real = mask.bool()  # padded positions' logits are not defined the same way
    torch.testing.assert_close(ours[real], ref[real], rtol=0, atol=atol)


# ---- patched == unpatched ----

@pytest.mark.parametrize("kind", ["tiny", "llama-8/2", "mistral-4/2", "qwen2-4/2", "qwen2-8/2"])
def test_patched_logits_equal_unpatched_fp32(kind, tiny_cpu):
    if kind == "tiny":
        model = tiny_cpu()
    else:
        model_type, heads = kind.split("-")
        h, kv = (int(x) for x in heads.split("/"))
        model = random_llama(model_type, num_attention_heads=h, num_key_value_heads=kv)
    ids = _ids(model)
    mask = _left_padded(ids)
    ref = _logits(model, ids, mask)
    report = fuseinfer.patch(model)
    assert not report.skipped, report.skipped
    swapped = {s.new_class for s in report.swaps}
    arch = type(model).__name__.removesuffix("ForCausalLM")
    assert {f"Fused{arch}DecoderLayer", f"Fused{arch}Attention", f"Fused{arch}MLP", f"Fused{arch}RMSNorm"} <= swapped
    _assert_logits_close(_logits(model, ids, mask), ref, mask, ATOL32)
    fuseinfer.unpatch(model)


def test_patched_logits_equal_unpatched_bf16(tiny_cpu):
    """bf16 on CPU: every op's reference rounds as transformers does, but the fused GEMMs may round otherwise;
    held to the fp32 model: |patched - fp32| <= 2 |unpatched bf16 - fp32| + a small atol."""
    model32 = tiny_cpu()
    model = tiny_cpu(torch.bfloat16)
    ids = _ids(model)
    mask = _left_padded(ids)
    ref32, ref16 = _logits(model32, ids, mask), _logits(model, ids, mask)
    fuseinfer.patch(model)
    ours = _logits(model, ids, mask)
    real = mask.bool()
    err, base = (ours - ref32)[real].abs(), (ref16 - ref32)[real].abs()
    assert (err <= 2 * base + 0.05).all(), float((err - 2 * base).max())
    assert err.mean() <= 1.5 * base.mean()


@pytest.mark.parametrize("fold", [True, False])
def test_patch_runs_the_fused_ops(tiny_cpu, monkeypatch, fold):
    """The patched forward calls the fused ops (not the original modules' math): each op counted where the
    modules call it, with the RMSNorms folded into the next GEMV (the default) and not."""
    from fuseinfer.layers import attention_backend
    from fuseinfer.layers import linear as linear_layer

    monkeypatch.setattr(llama_modules, "FOLD_NORMS", fold)
    monkeypatch.setattr(llama_modules, "FOLD_MAX_ROWS", 16)  # (every decode row count)

    model = tiny_cpu()
    fuseinfer.patch(model)
    calls: dict[str, int] = {}

    def counting(namespace, name, setter=monkeypatch.setattr):
        original = namespace[name] if isinstance(namespace, dict) else getattr(namespace, name)

        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        if isinstance(namespace, dict):
            monkeypatch.setitem(namespace, name, wrapped)
        else:
            setter(namespace, name, wrapped)

    for name in ("add_rms_norm", "qkv_rope", "linear_rope_append", "silu_mul", "linear_epilogue", "rms_norm_linear"):
        counting(llama_modules, name)
    counting(linear_layer, "linear_epilogue")
    counting(attention_backend.IMPLS, "fuseinfer")
    modules_forward(model, input_ids=_ids(model, rows=1, length=5))
    layers = model.config.num_hidden_layers
    if fold:
        # 5 rows (GEMV sizes): post_attention_layernorm folded into gate/up (rms_norm_linear with silu_mul); the
        # input norm runs (q/k/v folds it only when it appends to a static cache); q/k/v with the rotary (one op),
        # o_proj, down_proj
        assert calls == {"add_rms_norm": layers + 1, "rms_norm_linear": layers, "linear_rope_append": layers,
                         "linear_epilogue": 2 * layers, "fuseinfer": layers}, calls
        return
    # 2 RMSNorms per layer + the final one; q/k/v with the rotary (one op); o_proj and down_proj per layer; gate/up:
    # the module's own call, with silu_mul as the linear's activation (no silu_mul call of its own)
    assert calls == {"add_rms_norm": 2 * layers + 1, "linear_rope_append": layers,
                     "linear_epilogue": 3 * layers, "fuseinfer": layers}, calls


# ---- perplexity ----

@pytest.mark.slow
def test_wikitext2_perplexity_within_a_tenth_of_a_percent(tiny_cpu, tiny_llama_path):
    ppl_eager, ppl_patched = _perplexities(tiny_cpu(), tiny_llama_path, windows=3)
    print(f"llama-wt2-tiny WikiText-2 test PPL (3 windows of 512): eager {ppl_eager:.4f}, patched {ppl_patched:.4f}")
    assert abs(ppl_patched / ppl_eager - 1) < 1e-3
    assert ppl_eager < 1000  # a trained model (a broken tokenizer or data path would give thousands)


def _perplexities(model, path, windows: int, quant=None, device="cpu") -> tuple[float, float]:
    """(eager, patched) WikiText-2 test perplexity over ``windows`` non-overlapping windows of 512 tokens."""
    if not (WIKITEXT / "wiki.test.raw").exists():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT}")
    from transformers import AutoTokenizer

    from fuseinfer.core.data import load_text
    from fuseinfer.harness.perplexity import gptq_windows, perplexity

    text = load_text("test", WIKITEXT).text[:400_000]
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids
    wins = gptq_windows(ids, 512, windows)

    @torch.no_grad()
    def loss(x, labels):
        return model(input_ids=x, labels=labels).loss

    eager = perplexity(loss, wins, torch.device(device)).ppl
    fuseinfer.patch(model, PatchConfig(quant=quant))
    patched = perplexity(loss, wins, torch.device(device)).ppl
    if quant is None:
        fuseinfer.unpatch(model)
    assert math.isfinite(eager) and math.isfinite(patched)
    return eager, patched


# ---- generation ----

@pytest.mark.parametrize("kind", ["tiny", "qwen2", "mistral"])
def test_greedy_tokens_equal_transformers_with_left_padding(kind, tiny_cpu):
    # (random weights 10x transformers' init: attention far from uniform, so that a wrong rotary changes the tokens)
    model = tiny_cpu() if kind == "tiny" else random_llama(kind, num_attention_heads=8, num_key_value_heads=2,
                                                           initializer_range=0.2)
    ids = _ids(model, rows=3, length=12, seed=1)
    mask = _left_padded(ids)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                             pad_token_id=0)[:, ids.shape[1]:]
    fuseinfer.patch(model)
    ours = fuseinfer.generate(model, ids, mask, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    assert torch.equal(ours[:, ids.shape[1]:] if ours.shape[1] > 10 else ours, ref)
    with torch.no_grad():
        patched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                                 pad_token_id=0)
    assert torch.equal(patched[:, ids.shape[1]:], ref)
    fuseinfer.unpatch(model)


def test_fast_decode_takes_the_family_forward(tiny_cpu):
    """fuseinfer.generate runs this family's decode forward over the static cache (per op: no one-kernel step), and
    for the prompt where its RuntimeConfig says prefill='module'."""
    from fuseinfer.models.llama import decode as llama_decode
    from fuseinfer.runtime import decode as rt

    model = tiny_cpu()
    fuseinfer.patch(model)
    calls = []
    original = llama_decode.forward_last_logits

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    llama_decode.forward_last_logits = counting
    try:
        ids = _ids(model, rows=2, length=6)
        fuseinfer.generate(model, ids, torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4)
    finally:
        llama_decode.forward_last_logits = original
    assert [tuple(s) for s in calls] == [(2, 1), (2, 1), (2, 1)]  # a token per step (the prompt: the lean loop)
    assert models.family("llama").decode_step_kernel(model, None)[0] is None
    session = next(s for s in rt.sessions_of(model)[0].values() if hasattr(s, "path"))
    assert session.path.startswith("per op")
    with fuseinfer.runtime.using_runtime(model, prefill="module"):  # the prompt through the patched modules
        calls.clear()
        llama_decode.forward_last_logits = counting
        try:
            fuseinfer.generate(model, ids, torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2)
        finally:
            llama_decode.forward_last_logits = original
        assert [tuple(s) for s in calls] == [(2, 6), (2, 1)]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_transformers_caches_run_through_update(cache, tiny_cpu):
    """The patched attention over transformers' own caches (a DynamicCache, a StaticCache): prefill then token by
    token equals the unpatched model's logits."""
    from transformers import DynamicCache, StaticCache

    model = tiny_cpu()
    ids = _ids(model, rows=2, length=10)

    @torch.no_grad()
    def incremental():
        c = DynamicCache(config=model.config) if cache == "dynamic" else \
            StaticCache(config=model.config, max_cache_len=16)
        out = [model(input_ids=ids[:, :6], past_key_values=c, use_cache=True).logits[:, -1]]
        for t in range(6, 10):
            out.append(model(input_ids=ids[:, t:t + 1], past_key_values=c, use_cache=True,
                             cache_position=torch.tensor([t])).logits[:, -1])
        return torch.stack(out, 1).float()

    ref = incremental()
    fuseinfer.patch(model)
    torch.testing.assert_close(incremental(), ref, rtol=0, atol=ATOL32)


# ---- unpatch, save / reload ----

def _fuseinfer_attrs(model):
    return sorted(f"{n}.{k}" for n, m in model.named_modules() for k in vars(m)
                  if k.startswith("_fuseinfer") and k != "_fuseinfer_lock" or k in ("qkv_weight", "gate_up_weight"))


@pytest.mark.parametrize("kind", ["tiny", "qwen2"])
def test_unpatch_is_exact(kind, tiny_cpu):
    model = tiny_cpu() if kind == "tiny" else random_llama("qwen2")
    before, classes = state(model), {n: type(m) for n, m in model.named_modules()}
    impl, ids = model.config._attn_implementation, _ids(model)
    ref = _logits(model, ids, None)
    fuseinfer.patch(model)
    assert _fuseinfer_attrs(model)
    fuseinfer.unpatch(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert_same_state(model, before)
    assert _fuseinfer_attrs(model) == []
    assert model.config._attn_implementation == impl
    # every projection has storage of its own again (no view of a freed fused tensor)
    for layer in model.model.layers:
        ptrs = [getattr(layer.self_attn, n).weight.data_ptr() for n in ("q_proj", "k_proj", "v_proj")]
        ptrs += [getattr(layer.mlp, n).weight.data_ptr() for n in ("gate_proj", "up_proj")]
        assert len(set(ptrs)) == 5
    assert torch.equal(_logits(model, ids, None), ref)


def test_state_dict_keeps_names_and_values_while_patched(tiny_cpu):
    model = tiny_cpu()
    before = state(model)
    fuseinfer.patch(model)
    assert_same_state(model, before)
    attn = model.model.layers[0].self_attn
    # the q/k/v weights are views of the one fused tensor, in its row order
    rows = attn.q_proj.out_features
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight.data_ptr() + rows * attn.qkv_weight.stride(0) * 4
    assert attn.qkv_weight.shape == (rows + 2 * attn.k_proj.out_features, model.config.hidden_size)


def test_save_pretrained_of_a_patched_model_reloads_as_the_original(tiny_cpu, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_cpu()
    before = state(model)
    fuseinfer.patch(model)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(again.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert again.config._attn_implementation != "fuseinfer"
    assert_same_state(again, before)


def test_to_and_deepcopy_keep_the_fused_views(tiny_cpu):
    import copy

    model = tiny_cpu()
    fuseinfer.patch(model)
    ids = _ids(model)
    ref = _logits(model, ids, None)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.weight.mul_(0.5)  # the copy's fused tensor moves with its views
    assert not torch.allclose(_logits(twin, ids, None), ref)
    assert torch.equal(_logits(model, ids, None), ref)
    model.to(torch.float64).to(torch.float32)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    torch.testing.assert_close(_logits(model, ids, None), ref, rtol=0, atol=ATOL32)


# ---- the engine's checks ----

def test_filter_fn_and_hooks_leave_modules_unswapped(tiny_cpu):
    model = tiny_cpu()
    ids = _ids(model)
    mask = _left_padded(ids)
    ref = _logits(model, ids, mask)
    model.model.layers[2].mlp.up_proj.register_forward_hook(lambda *a: None)
    report = fuseinfer.patch(model, PatchConfig(filter_fn=lambda m, name: "layers.0." not in name
                                                and not name.endswith("layers.0")))
    names = {s.name for s in report.swaps}
    assert "model.layers.0" not in names and "model.layers.0.self_attn" not in names
    assert "model.layers.1.mlp" in names and "model.layers.2.mlp" not in names
    assert any(n == "model.layers.2.mlp" and "hooks" in why for n, why in report.skipped)
    _assert_logits_close(_logits(model, ids, mask), ref, mask, ATOL32)
    fuseinfer.unpatch(model)


def test_training_mode_runs_the_original_forwards(tiny_cpu):
    model = tiny_cpu().train()
    report = fuseinfer.patch(model)
    assert ("attention", "model is in training mode; call model.eval() first") in report.skipped
    ids = _ids(model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[0].self_attn.k_proj.weight.grad is not None
    forward, why = models.family("llama").decode_forward(model)
    assert forward is None and "model.eval()" in why
    fuseinfer.unpatch(model)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_eval_mode_gradients_to_the_inputs(quant):
    """In eval mode with frozen weights (fp32, or W8A16's int8 ones), gradients to inputs_embeds flow through the
    patched q/k/v (the GEMM and the rotary pass: the one-op projection writes k and v into tensors, which autograd
    cannot follow) and match the unpatched model's."""
    from fuseinfer import Int8WeightOnly

    model = random_llama("qwen2").requires_grad_(False)
    embeds = model.get_input_embeddings()(_ids(model, rows=2, length=7)).detach()

    def grad_of(m):
        x = embeds.clone().requires_grad_()
        m(inputs_embeds=x).logits.float().square().mean().backward()
        return x.grad

    ref = grad_of(model)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly() if quant else None))
    with fuseinfer.runtime.using_runtime(model, prefill="module"):
        ours = grad_of(model)
    if quant:  # int8 weights: the gradient of a slightly different model
        assert torch.nn.functional.cosine_similarity(ours.flatten(), ref.flatten(), dim=0) > 0.99
    else:
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model_type,overrides", [
    ("mistral", dict(sliding_window=64, max_position_embeddings=256)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
])
def test_sliding_window_is_refused_with_the_fix(model_type, overrides):
    model = random_llama(model_type, **overrides)
    before = state(model)
    with pytest.raises(FuseInferError, match="sliding") as err:
        fuseinfer.patch(model)
    assert "\n" not in str(err.value)
    assert_same_state(model, before)
    assert not _fuseinfer_attrs(model) and type(model.model.layers[0]).__module__.startswith("transformers")


def test_mistral_window_no_shorter_than_the_context_is_patched():
    model = random_llama("mistral", sliding_window=256, max_position_embeddings=256)
    ids = _ids(model)
    ref = _logits(model, ids, None)
    fuseinfer.patch(model)
    torch.testing.assert_close(_logits(model, ids, None), ref, rtol=0, atol=ATOL32)


def test_base_model_is_patched_too():
    from transformers import AutoModel

    causal = random_llama("qwen2")
    base = AutoModel.from_config(causal.config, attn_implementation="sdpa").eval()
    base.load_state_dict(causal.model.state_dict())
    ids = _ids(causal)
    with torch.no_grad():
        ref = base(input_ids=ids).last_hidden_state
    report = fuseinfer.patch(base)
    assert any(s.name == "layers.0.self_attn" for s in report.swaps)
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).last_hidden_state, ref, rtol=0, atol=ATOL32)
    forward, why = models.family("qwen2").decode_forward(base)
    assert forward is None and "causal LM" in why
    fuseinfer.unpatch(base)


def test_empty_input_is_one_clear_error(tiny_cpu):
    model = tiny_cpu()
    fuseinfer.patch(model)
    with pytest.raises(FuseInferError, match="empty input"):
        model(input_ids=torch.zeros(1, 0, dtype=torch.long))


# ---- what the feature packages read ----

def test_every_random_config_builds_on_meta_with_its_kv_layout():
    names = {name for name, mt in models.random_configs().items() if mt in ("llama", "mistral", "qwen2")}
    assert names == {"meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-1.5B",
                     "mistralai/Mistral-7B-v0.3"}
    expected = {"meta-llama/Llama-3.2-1B": (8, 64), "meta-llama/Llama-3.1-8B": (8, 128),
                "Qwen/Qwen2.5-1.5B": (2, 128), "mistralai/Mistral-7B-v0.3": (8, 128)}
    for name in names:
        fam = models.family(models.random_configs()[name])
        assert name in fam.random_configs() and "model_type" not in fam.random_configs()[name]
        cfg = fam.build_config(name)
        assert cfg.model_type == fam.model_type
        model = fam.empty_model(cfg, torch.bfloat16)
        assert all(p.is_meta for p in model.parameters())
        assert fam.kv_layout(cfg) == expected[name]
        heads, d = fam.kv_layout(cfg)
        assert model.model.layers[0].self_attn.k_proj.weight.shape == (heads * d, cfg.hidden_size)
        assert fam.intermediate_size(cfg) == cfg.intermediate_size
        assert fam.decoder_layers(model)[0] == "model.layers"


def test_init_buffers_recomputes_the_rotary_tables():
    fam = models.family("llama")
    cfg = fam.build_config("meta-llama/Llama-3.2-1B")
    model = fam.empty_model(cfg, torch.float32)
    fam.init_buffers(model)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ref = LlamaRotaryEmbedding(LlamaConfig(**fam.random_configs()["meta-llama/Llama-3.2-1B"]))
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.inv_freq)
    assert model.model.rotary_emb.attention_scaling == ref.attention_scaling


def test_family_interface_refusals_are_clear():
    fam = models.family("llama")
    model = random_llama()
    assert fam.prefill_reason(model)
    assert fam.tp_reason(model, 2) is None and "num_key_value_heads=2" in fam.tp_reason(model, 4)  # (tp.py)
    assert fam.export_spec(model).kv_heads == model.config.num_key_value_heads  # (export.py)
    with pytest.raises(FuseInferError, match="SmoothQuant"):
        fam.smoothing_groups(model)
    assert fam.module_kinds()["gate_proj"] == "mlp_in" and fam.module_kinds()["o_proj"] == "attn_out"
    assert models.family("mistral").config_class().__name__ == "MistralConfig"
    assert models.family("qwen2").config_class().__name__ == "Qwen2Config"


def test_attention_weights_and_hidden_states_as_transformers_records_them(tiny_llama_path):
    """output_attentions / output_hidden_states: the patched model (grouped-query k / v repeated for the weights)
    records what transformers' eager model records."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = _ids(model)
    mask = _left_padded(ids)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        fuseinfer.patch(model)
        ours = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert len(ours.attentions) == len(ref.attentions) == model.config.num_hidden_layers
    for a, b in zip(ours.attentions, ref.attentions):
        assert a.shape == (3, model.config.num_attention_heads, 21, 21)
        torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=1e-6)  # (rows 1, 2: padded queries differ in row 0)
    for a, b in zip(ours.hidden_states, ref.hidden_states):
        _assert_logits_close(a, b, mask, ATOL32)


@pytest.mark.parametrize("settings", [dict(num_beams=3), dict(repetition_penalty=1.3, no_repeat_ngram_size=2)],
                         ids=["beams_beam_path", "processors_fast_path"])
def test_patched_generate_with_other_settings_equals_transformers(settings, tiny_cpu):
    """Beam search (one graph replay per step, runtime/beam.py) and logits processors (fast decode)."""
    model = tiny_cpu()
    ids = _ids(model, rows=2, length=12, seed=5)
    mask = _left_padded(ids)[:2]
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1, **settings)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        fuseinfer.patch(model)
        assert torch.equal(model.generate(ids, **kwargs), ref)


def test_report_names_sdpa_where_grouped_query_attention_has_no_kernel(monkeypatch):
    """On a GPU whose attention kernel takes no grouped-query k / v, the report says SDPA runs the attention (the
    backends faked as CUDA here: the branch is host-side)."""
    monkeypatch.setattr(llama_modules, "_backends", lambda module, ops, like: {op: "cuda" for op in ops})
    monkeypatch.setattr(llama_modules, "KERNEL_GQA", False)
    report = fuseinfer.patch(random_llama(num_attention_heads=4, num_key_value_heads=2))
    attn = next(s for s in report.swaps if s.new_class == "FusedLlamaAttention")
    assert attn.ops["attention"].startswith("sdpa (grouped-query") and attn.ops["qkv"] == "cuda"
    report = fuseinfer.patch(random_llama(num_attention_heads=4, num_key_value_heads=4))
    assert next(s for s in report.swaps if s.new_class == "FusedLlamaAttention").ops["attention"] == "cuda"


@pytest.mark.parametrize("fold", [True, False])
def test_patched_model_compiles_to_one_graph_of_the_registered_ops(fold, monkeypatch):
    from conftest import traced_by_compile

    monkeypatch.setattr(llama_modules, "FOLD_NORMS", fold)
    monkeypatch.setattr(llama_modules, "FOLD_MAX_ROWS", 18)  # (the 2 x 9 rows below fold)
    model = random_llama("qwen2")
    ids = _ids(model, rows=2, length=9)
    ref = _logits(model, ids, None)
    fuseinfer.patch(model)
    with torch.no_grad():
        out, code = traced_by_compile(model, input_ids=ids)
    torch.testing.assert_close(out.logits.float(), ref, rtol=0, atol=ATOL32)
    layers = model.config.num_hidden_layers
    counts = {op: code.count(f"fuseinfer.{op}") for op in ("add_rms_norm", "qkv_rope", "linear_rope_append", "silu_mul",
                                                            "linear_epilogue", "rms_norm_linear")}
    if fold:  # post_attention_layernorm in gate/up's op (the input norm folds only into a static cache's q/k/v)
        assert counts == {"add_rms_norm": layers + 1, "qkv_rope": 0, "linear_rope_append": layers, "silu_mul": 0,
                          "linear_epilogue": 2 * layers, "rms_norm_linear": layers}, counts
        return
    # per layer: 2 norms, q/k/v with the rotary (one op), GEMMs o_proj, gate/up (silu_mul its activation: no op of
    # its own), down_proj; the final norm
    assert counts == {"add_rms_norm": 2 * layers + 1, "qkv_rope": 0, "linear_rope_append": layers, "silu_mul": 0,
                      "linear_epilogue": 3 * layers, "rms_norm_linear": 0}, counts


def test_random_model_materialized_from_meta_runs_fast_decode():
    """The eval's random: models: built on meta, materialized (the rotary tables recomputed), patched, decoded."""
    from fuseinfer.harness.materialize import materialize, meta_model, random_init

    fam = models.family("qwen2")
    cfg = fam.build_config("Qwen/Qwen2.5-1.5B")
    cfg.num_hidden_layers, cfg.vocab_size = 1, 1000
    model = materialize(meta_model(cfg, torch.float32), "cpu", random_init(0, 0.02))
    ref = model.model.rotary_emb.compute_default_rope_parameters(cfg)[0]
    assert torch.equal(model.model.rotary_emb.inv_freq, ref)
    fuseinfer.patch(model)
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    assert fuseinfer.generate(model, ids, max_new_tokens=3, min_new_tokens=3).shape == (2, 11)


def test_mlp_with_another_activation_is_skipped_with_the_reason():
    model = random_llama(hidden_act="gelu")
    ids = _ids(model)
    ref = _logits(model, ids, None)
    report = fuseinfer.patch(model)
    skipped = dict(report.skipped)
    assert set(skipped) == {"model.layers.0.mlp", "model.layers.1.mlp"} and "not SiLU" in skipped["model.layers.0.mlp"]
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    torch.testing.assert_close(_logits(model, ids, None), ref, rtol=0, atol=ATOL32)


@pytest.mark.parametrize("ops", [("layer_norm",), ("linear",), ("qkv",), ("attention",), ("qkv", "attention"),
                                 ("layer_norm", "linear", "attention")])
def test_any_subset_of_ops_keeps_the_logits(ops):
    model = random_llama("qwen2", num_attention_heads=8, num_key_value_heads=2)
    ids = _ids(model)
    mask = _left_padded(ids)
    ref = _logits(model, ids, mask)
    report = fuseinfer.patch(model, PatchConfig(ops=ops))
    assert report.swaps and not report.skipped
    _assert_logits_close(_logits(model, ids, mask), ref, mask, ATOL32)
    from fuseinfer.runtime.args import decode_forward

    forward, why = decode_forward(model)
    assert forward is None and "every op" in why
    fuseinfer.unpatch(model)
