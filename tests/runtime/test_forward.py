"""The fast forward of a patched causal LM (fuseinfer/runtime/forward.py): ``model(input_ids)`` through the family's
lean loop gives the patched modules' outputs (logits, loss, the DynamicCache transformers continues from), every
call it cannot serve runs the patched modules, and on CUDA it replays CUDA graphs per (batch, length bucket)."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import VARIANTS, random_opt
from helpers import given, settings, st

import fuseinfer
from fuseinfer.runtime import forward as fw
from fuseinfer.runtime.cache import COUNTS


def _batch(vocab=512, rows=3, length=21, device="cpu", seed=1):
    """Left-padded ids and mask (B, S): row 1 has 5 pads, the last row all but its last token padded (one row: no
    padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, :5] = 0
        mask[-1, :length - 1] = 0
    return ids.to(device), mask.to(device)


def _fast(model, *args, **kwargs):
    """(model(*args, **kwargs) under no_grad, whether the fast forward served it)."""
    before = COUNTS["fast_forward"]
    with torch.no_grad():
        out = model(*args, **kwargs)
    return out, COUNTS["fast_forward"] - before == 1


def _modules(model, *args, **kwargs):
    """The same call through the patched modules (RuntimeConfig.prefill='module')."""
    with fuseinfer.runtime.using_runtime(model, prefill="module"):
        out, fast = _fast(model, *args, **kwargs)
    assert not fast
    return out


def _pair(**cfg):
    """(unpatched, patched) copies of one random OPT."""
    ref = random_opt(**cfg)
    model = copy.deepcopy(ref)
    fuseinfer.patch(model)
    return ref, model


def _same_cache(a, b, length: int) -> None:
    assert a.get_seq_length() == b.get_seq_length() == length
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


# ---- what it computes ----

@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
def test_fast_forward_equals_the_patched_modules_and_the_unpatched_model(variant, padded):
    """Full logits, the cache's keys and values: bit for bit the patched modules' on CPU (the same ops on the same
    rows), and the unpatched model's within fp32 tolerance at the real positions."""
    ref, model = _pair(**VARIANTS[variant])
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask) if padded else {}
    out, fast = _fast(model, ids, **kwargs)
    assert fast
    mods = _modules(model, ids, **kwargs)
    assert out.logits.dtype == mods.logits.dtype and torch.equal(out.logits, mods.logits)
    _same_cache(out.past_key_values, mods.past_key_values, ids.shape[1])
    with torch.no_grad():
        unpatched = ref(ids, **kwargs)
    real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    torch.testing.assert_close(out.logits[real], unpatched.logits[real], rtol=1e-5, atol=1e-5)
    for la, lb in zip(out.past_key_values.layers, unpatched.past_key_values.layers):
        torch.testing.assert_close(la.keys[real[:, None].expand(la.keys.shape[:3])],
                                   lb.keys[real[:, None].expand(lb.keys.shape[:3])], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep", [1, 5, 0, 100, "tensor"])
def test_logits_to_keep_and_labels(keep):
    """logits_to_keep (an int, or a 1-D tensor of positions) and the loss from labels, as the patched modules give
    them (the loss: transformers' loss_function on those logits)."""
    _, model = _pair()
    ids, mask = _batch()
    keep = torch.tensor([0, 7, 20]) if keep == "tensor" else keep
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = dict(attention_mask=mask, logits_to_keep=keep)
    if isinstance(keep, int) and keep in (0, 100):  # (labels need logits at every position)
        kwargs["labels"] = labels
    out, fast = _fast(model, ids, **kwargs)
    assert fast
    mods = _modules(model, ids, **kwargs)
    assert torch.equal(out.logits, mods.logits)
    width = {1: 1, 5: 5, 0: 21, 100: 21}.get(keep, 3) if isinstance(keep, int) else 3
    assert out.logits.shape == (3, width, 512)
    if "labels" in kwargs:
        assert out.loss is not None and torch.equal(out.loss, mods.loss)
    else:
        assert out.loss is None


def test_trained_tiny_model_logits_cache_and_greedy_continuation(tiny_model_path):
    """The trained tiny OPT with a tokenizer's left padding: the fast forward's logits are the unpatched model's,
    its cache continues one token (model(next, past_key_values=...)) to the unpatched model's logits, and
    generate after it gives the unpatched tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model = copy.deepcopy(ref)
    fuseinfer.patch(model)
    tok = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    enc = tok(["The tower is", "In 1990 , the band released their second album"], return_tensors="pt",
              padding=True)
    out, fast = _fast(model, **enc)
    assert fast
    with torch.no_grad():
        unpatched = ref(**enc)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(out.logits[real], unpatched.logits[real], rtol=1e-4, atol=1e-4)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    assert torch.equal(nxt, unpatched.logits[:, -1].argmax(-1, keepdim=True))
    mask = torch.cat([enc.attention_mask, torch.ones_like(nxt)], 1)
    with torch.no_grad():
        step = model(nxt, attention_mask=mask, past_key_values=out.past_key_values)
        ref_step = ref(nxt, attention_mask=mask, past_key_values=unpatched.past_key_values)
    torch.testing.assert_close(step.logits, ref_step.logits, rtol=1e-4, atol=1e-4)
    assert step.past_key_values.get_seq_length() == enc.input_ids.shape[1] + 1
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(model.generate(**enc, **gen), ref.generate(**enc, **gen))


@pytest.mark.parametrize("model_type", ["opt", "llama", "mistral", "qwen2"])
def test_each_family_with_a_lean_loop_serves_its_causal_lm(model_type):
    """Family-generic: a causal LM whose family implements ``lean_hidden`` gets the fast forward (the patched
    modules' logits and cache bit for bit on CPU, with left padding; a cached continuation and generate as the
    unpatched model's); one whose family has none keeps its class and the modules."""
    from conftest import random_llama

    from fuseinfer.models import family
    from fuseinfer.models.base import ModelFamily

    ref = random_opt() if model_type == "opt" else random_llama(model_type)
    model = copy.deepcopy(ref)
    fuseinfer.patch(model)
    has_loop = type(family(model_type)).lean_hidden is not ModelFamily.lean_hidden
    assert (type(model) is not type(ref)) == has_loop
    ids, mask = _batch()
    out, fast = _fast(model, ids, attention_mask=mask)
    assert fast == has_loop
    mods = _modules(model, ids, attention_mask=mask)
    assert torch.equal(out.logits, mods.logits)
    _same_cache(out.past_key_values, mods.past_key_values, ids.shape[1])
    with torch.no_grad():
        unpatched = ref(ids, attention_mask=mask)
        nxt = out.logits[:, -1:].argmax(-1)  # (B, 1)
        longer = torch.cat([mask, torch.ones_like(nxt)], 1)
        step = model(nxt, attention_mask=longer, past_key_values=out.past_key_values)
        ref_step = ref(nxt, attention_mask=longer, past_key_values=unpatched.past_key_values)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], unpatched.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.logits, ref_step.logits, rtol=1e-5, atol=1e-5)
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=ref.config.pad_token_id)
    assert torch.equal(model.generate(ids, **gen), ref.generate(ids, **gen))


@pytest.mark.parametrize("lm_head", [False, True], ids=["int8_layers", "int8_lm_head_too"])
def test_int8_weight_only_models(lm_head):
    """A W8A16 model takes the fast forward (its lean loop runs the int8 linears): the patched modules' logits and
    cache; with its LM head quantized too, the modules serve the call."""
    model = random_opt()
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly(include_lm_head=lm_head)))
    ids, mask = _batch()
    out, fast = _fast(model, ids, attention_mask=mask)
    assert fast != lm_head
    mods = _modules(model, ids, attention_mask=mask)
    assert torch.equal(out.logits, mods.logits)
    _same_cache(out.past_key_values, mods.past_key_values, ids.shape[1])


def test_an_empty_dynamic_cache_passed_in_is_filled_and_returned():
    from transformers import DynamicCache

    _, model = _pair()
    ids, mask = _batch()
    cache = DynamicCache(config=model.config)
    out, fast = _fast(model, ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert fast and out.past_key_values is cache
    _same_cache(cache, _modules(model, ids, attention_mask=mask).past_key_values, ids.shape[1])
    nxt = ids[:, :1]
    mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    out, fast = _fast(model, nxt, attention_mask=mask, past_key_values=cache)  # no longer empty: the modules
    assert not fast and cache.get_seq_length() == ids.shape[1] + 1


def test_transformers_generate_leaves_its_calls_to_the_modules_and_the_fast_forward_intact():
    """patched model.generate with a cache of the caller's runs transformers' own loop, with the attention
    implementation the model had before patching: the prefill then runs the patched modules (which run that one),
    the tokens are the unpatched ones, and the next plain call still takes the fast forward (nothing cached the
    refusal)."""
    from transformers import DynamicCache

    ref, model = _pair()
    ids, mask = _batch()
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    expected = ref.generate(ids, past_key_values=DynamicCache(config=ref.config), **gen)
    before = COUNTS["fast_forward"]
    with torch.no_grad():
        out = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)
    assert COUNTS["fast_forward"] == before and torch.equal(out, expected)
    assert _fast(model, ids, attention_mask=mask)[1]


def test_use_cache_false_position_ids_and_return_dict_false():
    _, model = _pair()
    ids, mask = _batch()
    out, fast = _fast(model, ids, attention_mask=mask, use_cache=False)
    assert fast and out.past_key_values is None
    pos = torch.arange(ids.shape[1])[None] + 3  # (1, S): explicit positions
    out, fast = _fast(model, ids, position_ids=pos)
    assert fast and torch.equal(out.logits, _modules(model, ids, position_ids=pos).logits)
    out, fast = _fast(model, ids, attention_mask=mask, return_dict=False, use_cache=False)
    assert fast and isinstance(out, tuple) and torch.equal(out[0], _modules(model, ids, attention_mask=mask).logits)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(1, 40), pads=st.lists(st.integers(0, 39), min_size=3, max_size=3),
       seed=st.integers(0, 5))
def test_any_left_padding_gives_the_patched_modules_logits(rows, length, pads, seed):
    model = _hypothesis_model()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, :min(pads[r], length - 1)] = 0
    out, fast = _fast(model, ids, attention_mask=mask)
    assert fast
    mods = _modules(model, ids, attention_mask=mask)
    assert torch.equal(out.logits, mods.logits)
    _same_cache(out.past_key_values, mods.past_key_values, length)


_MODEL: list = []


def _hypothesis_model():
    if not _MODEL:
        _MODEL.append(_pair(do_layer_norm_before=False, word_embed_proj_dim=32)[1])
    return _MODEL[0]


# ---- what it leaves to the patched modules ----

@pytest.mark.parametrize("case", ["grad_enabled", "training", "hook", "output_hidden_states", "output_attentions",
                                  "config_output_hidden_states", "inputs_embeds", "prefill_module", "past_tokens",
                                  "logits_to_keep_2d", "unknown_argument", "unpatched_qkv", "autocast"])
def test_every_call_it_cannot_serve_runs_the_patched_modules(case):
    """Each condition sends the call to the patched modules (the fast forward serves nothing), whose outputs it
    returns as before."""
    from transformers import DynamicCache

    _, model = _pair()
    ids, mask = _batch()
    kwargs = dict(input_ids=ids, attention_mask=mask)
    grad = case == "grad_enabled"
    if case == "training":
        model.train()
        model.config.dropout = 0.0
    elif case == "hook":
        model.model.decoder.layers[1].register_forward_hook(lambda *a: None)
    elif case in ("output_hidden_states", "output_attentions"):
        kwargs[case] = True
    elif case == "config_output_hidden_states":
        model.config.output_hidden_states = True
    elif case == "inputs_embeds":
        kwargs = dict(inputs_embeds=model.get_input_embeddings()(ids).detach(), attention_mask=mask)
    elif case == "prefill_module":
        fuseinfer.runtime.set_runtime(model, prefill="module")
    elif case == "past_tokens":
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :3], attention_mask=mask[:, :3], past_key_values=cache)
        kwargs = dict(input_ids=ids[:, 3:], attention_mask=mask, past_key_values=cache)
    elif case == "logits_to_keep_2d":
        kwargs["logits_to_keep"] = torch.ones_like(ids, dtype=torch.bool)
    elif case == "unknown_argument":
        kwargs["cu_seq_lens_q"] = torch.tensor([0, ids.shape[1]])
    elif case == "unpatched_qkv":
        k = model.model.decoder.layers[0].self_attn.k_proj
        k.weight.data = k.weight.detach().clone()
    before = COUNTS["fast_forward"]
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        try:
            model(**kwargs)
        except Exception:  # (a call the modules refuse is refused the same way: not the fast forward's business)
            pass
    assert COUNTS["fast_forward"] == before, case


def test_a_torch_compiled_model_traces_the_patched_modules():
    from conftest import traced_by_compile

    _, model = _pair()
    ids, mask = _batch()
    before = COUNTS["fast_forward"]
    with torch.no_grad():
        out, code = traced_by_compile(model, input_ids=ids, attention_mask=mask)
    assert COUNTS["fast_forward"] == before and "torch.ops.fuseinfer.attention" in code
    assert torch.equal(out.logits, _fast(model, ids, attention_mask=mask)[0].logits)


# ---- the class swap ----

def test_patch_swaps_the_class_unpatch_restores_it_and_copies_keep_it(tmp_path):
    from transformers import OPTForCausalLM

    ref, model = _pair()
    assert type(ref) is OPTForCausalLM
    assert type(model) is not OPTForCausalLM and isinstance(model, OPTForCausalLM)
    assert type(model).__name__ == "OPTForCausalLM" and type(model) is fw.fast_class(OPTForCausalLM)
    ids, mask = _batch()
    expected = _fast(model, ids, attention_mask=mask)[0].logits
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buf, weights_only=False)):
        assert type(twin) is type(model)
        out, fast = _fast(twin, ids, attention_mask=mask)
        assert fast and torch.equal(out.logits, expected)
    model.save_pretrained(tmp_path)
    assert '"OPTForCausalLM"' in (tmp_path / "config.json").read_text()
    fuseinfer.unpatch(model)
    assert type(model) is OPTForCausalLM
    out, fast = _fast(model, ids, attention_mask=mask)
    assert not fast
    fuseinfer.patch(model)
    assert type(model) is fw.fast_class(OPTForCausalLM) and _fast(model, ids)[1]


def test_only_causal_lms_of_a_family_with_a_lean_loop_get_the_class():
    from transformers import OPTConfig, OPTModel

    from fuseinfer.models.base import ModelFamily

    base = OPTModel(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, ffn_dim=32,
                              num_attention_heads=2, word_embed_proj_dim=32)).eval()
    fuseinfer.patch(base)
    assert type(base) is OPTModel
    fuseinfer.unpatch(base)

    class NoLean(ModelFamily):
        architectures = ("OPTForCausalLM",)
        patch = unpatch = decode_forward = None

    assert fw.fast_class_for(random_opt(), NoLean()) is None


def test_forward_positions_default_and_opt():
    """The positions the model's own forward gives: 0..S-1 by default (rotary families), OPT's count of real tokens
    with -1 on padding."""
    from fuseinfer.models import family
    from fuseinfer.models.base import ModelFamily

    ids, mask = _batch(rows=2, length=6)
    mask[0, :2] = 0
    opt = family("opt")
    assert torch.equal(ModelFamily.forward_positions(opt, None, ids, mask), torch.arange(6).expand(2, 6))
    assert torch.equal(opt.forward_positions(None, ids, mask),
                       torch.tensor([[-1, -1, 0, 1, 2, 3], [-1, -1, -1, -1, -1, 0]]))
    assert torch.equal(opt.forward_positions(None, ids, None), torch.arange(6).expand(2, 6))


# ---- the graph's parts that run on the CPU ----

def test_kv_sink_holds_what_the_lean_loop_appends():
    """The graph's kv_out (one buffer, filled as layers append) holds the plain list's keys and values."""
    _, model = _pair()
    ids, mask = _batch()
    fam = fuseinfer.patching.patch_state(model).family
    pos = fam.forward_positions(model, ids, mask)
    plain, sink = [], fw._KVSink(model.config.num_hidden_layers)
    a = fam.lean_hidden(model, ids, pos, mask.bool(), plain)
    b = fam.lean_hidden(model, ids, pos, mask.bool(), sink)
    assert torch.equal(a, b) and sink.count == len(plain) == 2
    assert sink.buffer.shape == (2, *ids.shape, 2, *plain[0][0].shape[1:2], plain[0][0].shape[-1])
    for (k, v), (kb, vb) in zip(plain, fw._kv_views(sink.buffer)):
        assert fw._side_by_side(k, v) is not None  # (OPT's k and v: views of one q/k/v output, one copy for both)
        assert torch.equal(kb, k) and torch.equal(vb, v)
    with pytest.raises(fuseinfer.FuseInferError, match="more than 2 layers"):
        sink.append(plain[0])


@pytest.mark.parametrize("b,h,length,d", [(1, 1, 1, 1), (2, 3, 5, 7), (3, 2, 16, 64)])
def test_kv_sink_copies_side_by_side_and_separate_keys_and_values(b, h, length, d):
    """Keys and values that are views of one (B, L, ..., k, v) row go in one copy; any others (separate tensors,
    another gap, transposed heads) in two; every layout holds the same values."""
    qkv = torch.randn(b, length, 3, h, d)
    views = qkv.unbind(2)  # 3 x (B, L, H, D)
    k, v = views[1].transpose(1, 2), views[2].transpose(1, 2)  # (B, H, L, D)
    gap = torch.randn(b, length, 4, h, d).unbind(2)
    cases = {"side by side": (k, v, True), "separate": (k.clone(), v.clone(), False),
             "a gap between": (gap[1].transpose(1, 2), gap[3].transpose(1, 2), False),
             "v before k": (v, k, False)}
    for name, (kk, vv, one) in cases.items():
        assert (fw._side_by_side(kk, vv) is not None) == one, name
        sink = fw._KVSink(2)
        sink.append((kk, vv))
        sink.append((vv, kk))
        (k0, v0), (k1, v1) = fw._kv_views(sink.buffer)
        assert k0.shape == (b, h, length, d), name
        assert torch.equal(k0, kk) and torch.equal(v0, vv) and torch.equal(k1, vv) and torch.equal(v1, kk), name


def test_probe_sees_a_move_of_the_model_tensors_and_the_cpu_takes_no_graph():
    _, model = _pair()
    probe = fw._Probe(model)
    assert probe.same()
    model.double()
    assert not probe.same()
    before = COUNTS["forward_graph"]
    _fast(model, _batch()[0])
    assert COUNTS["forward_graph"] == before


def test_release_drops_the_cache_template():
    _, model = _pair()
    _fast(model, _batch()[0])
    sessions = model.__dict__[fuseinfer.runtime.decode.SESSIONS_ATTR]
    assert (fw.KEY, "cache") in sessions
    fuseinfer.runtime.release(model)
    assert fuseinfer.runtime.decode.SESSIONS_ATTR not in model.__dict__


# ---- GPU: the graph path ----

def _cuda_pair(**cfg):
    """(fp32 reference, unpatched fp16, patched fp16) copies of one random OPT on CUDA."""
    base = dict(hidden_size=512, num_attention_heads=8, ffn_dim=2048, num_hidden_layers=4, vocab_size=4096,
                max_position_embeddings=1024)
    base.update(cfg)
    m32 = random_opt(device="cuda", **base)
    m16 = copy.deepcopy(m32).half()
    patched = copy.deepcopy(m16)
    fuseinfer.patch(patched)
    return m32, m16, patched


def _fp16_rule(ours, torch16, ref32, what):
    ours_err = (ours.float() - ref32).abs().max().item()
    torch_err = (torch16.float() - ref32).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-6, f"{what}: ours {ours_err:.3g} vs torch fp16 {torch_err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("length", [100, 128, 300])
def test_graph_forward_equals_the_lean_loop_and_the_fp16_rule(length):
    m32, m16, model = _cuda_pair()
    ids, mask = _batch(vocab=4096, rows=2, length=length, device="cuda")
    before = COUNTS["forward_graph"]
    out, fast = _fast(model, ids, attention_mask=mask)
    assert fast and COUNTS["forward_graph"] == before + 1
    assert list(fw.graph_stats(model)) == [(2, -(-length // 128) * 128, True)]
    again, _ = _fast(model, ids, attention_mask=mask)  # replayed, not captured again
    assert COUNTS["forward_graph"] == before + 1
    torch.testing.assert_close(again.logits, out.logits, rtol=0, atol=1e-3)
    with fuseinfer.runtime.using_runtime(model, prefill="lean"):  # (and the graphs released)
        lean, fast = _fast(model, ids, attention_mask=mask)
    assert fast
    real = mask.bool()
    # (the same kernels; cuBLASLt takes its heuristic's algorithm under capture, the tuned one eagerly)
    torch.testing.assert_close(out.logits[real], lean.logits[real], rtol=1e-2, atol=1e-2)
    for la, lb in zip(out.past_key_values.layers, lean.past_key_values.layers):
        assert la.keys.shape == lb.keys.shape == (2, 8, length, 64)
        torch.testing.assert_close(la.keys, lb.keys, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(la.values, lb.values, rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        ref32 = m32(ids, attention_mask=mask).logits
        torch16 = m16(ids, attention_mask=mask).logits
    _fp16_rule(out.logits[real], torch16[real], ref32[real], "graph forward")


@pytest.mark.gpu
def test_graph_outputs_held_across_calls_and_shapes():
    """A held output (logits, cache) is not overwritten by the next call's replay, of the same or another shape;
    each (batch, bucket, cache or not) is captured once; use_cache=False and logits_to_keep take the graphs too."""
    _, _, model = _cuda_pair(num_hidden_layers=2)
    a_ids, _ = _batch(vocab=4096, rows=1, length=60, device="cuda", seed=1)
    b_ids, _ = _batch(vocab=4096, rows=1, length=60, device="cuda", seed=2)
    before = COUNTS["forward_graph"]
    a, _ = _fast(model, a_ids)
    held = a.logits.clone(), a.past_key_values.layers[1].keys.clone()
    _fast(model, b_ids)  # the same graph, other tokens
    assert torch.equal(a.logits, held[0]) and torch.equal(a.past_key_values.layers[1].keys, held[1])
    c, fast = _fast(model, a_ids.repeat(1, 4)[:, :200])  # another bucket (256)
    assert fast and COUNTS["forward_graph"] == before + 2
    assert torch.equal(a.logits, held[0])
    d, fast = _fast(model, a_ids, use_cache=False, logits_to_keep=1)  # no k/v: its own graph
    assert fast and d.past_key_values is None and COUNTS["forward_graph"] == before + 3
    torch.testing.assert_close(d.logits[:, -1], held[0][:, -1], rtol=2e-3, atol=2e-3)
    assert len(fw.graph_stats(model)) == 3
    fuseinfer.runtime.release(model)
    assert not fw.graph_stats(model)
    # a continuation from the graph's cache equals the module path's
    nxt = a.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        step = model(nxt, past_key_values=a.past_key_values)
    with fuseinfer.runtime.using_runtime(model, prefill="module"), torch.no_grad():
        mods = model(a_ids)
        ref_step = model(nxt, past_key_values=mods.past_key_values)
    torch.testing.assert_close(step.logits, ref_step.logits, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_graph_forward_under_inference_mode_and_after_a_dtype_move():
    _, _, model = _cuda_pair(num_hidden_layers=2)
    ids, mask = _batch(vocab=4096, rows=2, length=40, device="cuda")
    with torch.inference_mode():
        a = model(ids, attention_mask=mask).logits.clone()
    b, fast = _fast(model, ids, attention_mask=mask)  # the same graph, outside inference mode
    assert fast
    torch.testing.assert_close(b.logits, a, rtol=0, atol=1e-3)
    before = COUNTS["forward_graph"]
    model.to(torch.bfloat16)  # every tensor moves: the graphs go, a new one is captured
    c, fast = _fast(model, ids, attention_mask=mask)
    assert fast and c.logits.dtype == torch.bfloat16 and COUNTS["forward_graph"] == before + 1


@pytest.mark.gpu
def test_greedy_tokens_of_the_fp16_tiny_model_after_a_graph_forward(tiny_model_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    model = copy.deepcopy(ref)
    fuseinfer.patch(model)
    ids = torch.tensor([[2, 133, 2064, 16, 10, 1539, 6, 5, 1440, 9]], device="cuda") % 8192
    out, fast = _fast(model, ids)
    assert fast
    with torch.no_grad():
        assert torch.equal(out.logits[:, -1].argmax(-1), ref(ids).logits[:, -1].argmax(-1))
    kwargs = dict(max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
