"""ONNX export of the Llama-architecture families (models/llama/export.py over fuseinfer.export's two strategies).

The step graph run eagerly as PyTorch (the contrib ops' reference forwards) against transformers, prompt and decode
steps over the past; the exports run by onnxruntime's CPU provider against PyTorch (fp32 and fp16), greedy tokens
of a left-padded batch against ``generate``, the node types of each flavour pinned, and the refusals. Models: the
shared tiny trained Llama (4 heads, 2 key/value heads, tied embeddings), a random Qwen2 (q/k/v biases, grouped-query),
a random Mistral with a sliding window shorter than the sequences, random Llamas with static rope scalings.
"""
from __future__ import annotations

import pytest
import torch

from conftest import random_llama
from fuseinfer.export import ExportError, OrtDecoder, to_onnx
from fuseinfer.export import manifest as mf
from fuseinfer.export.graph import FLAVOURS, DecoderGraph
from fuseinfer.models import family

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e .[export])")
import onnx  # noqa: E402

ATOL = 1e-4  # fp32 through onnxruntime: summation order only (as OPT's export tests)
EAGER_ATOL = 1e-5  # fp32 eager graph vs transformers, relative to the logits' size when they are under 1
CONTRIB = "com.microsoft"
# the random models of these tests: name -> random_llama arguments
RANDOM = {
    "qwen2": dict(model_type="qwen2"),  # q/k/v biases, 4 heads over 2 key/value heads
    "mistral_window": dict(model_type="mistral", sliding_window=4),  # sequences of 10-12: the window matters
    "qwen2_window_layer": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "llama_biases": dict(attention_bias=True, mlp_bias=True),  # o_proj / down_proj biases into the next norm
    "llama_mha": dict(num_key_value_heads=4),  # key/value heads = heads: still GroupQueryAttention when fused
    "llama_linear_rope": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama3_rope_head_dim": dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}),  # 4 * 32 != hidden 64; one KV head
}


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_exports(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_llama")
    return {fl: (to_onnx(tiny, root / fl, flavour=fl, source="llama-wt2-tiny"), root / fl) for fl in FLAVOURS}


@pytest.fixture(scope="module")
def qwen2():
    return random_llama(**RANDOM["qwen2"])


@pytest.fixture(scope="module")
def qwen2_exports(qwen2, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2")
    return {fl: (to_onnx(qwen2, root / fl, flavour=fl), root / fl) for fl in FLAVOURS}


def _batch(vocab, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :3] = 0  # left padding, as in batched generation
    return ids, mask


def _positions(mask):
    """The position ids generation gives a left-padded batch (and the graph computes from the mask)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


# --- the step graph, eagerly (the contrib ops' reference forwards) against transformers

def _check_eager(model, flavour, prompt_len=6):
    """The graph's logits over the whole batch (no past), then a prompt and one-token steps feeding the presents
    back as past, against one transformers forward; padded positions are not compared."""
    graph = DecoderGraph(model, flavour)
    spec = graph.spec
    ids, mask = _batch(spec.vocab, length=10)
    empty = [torch.zeros(2, spec.cache_heads, 0, spec.head_dim) for _ in range(2 * spec.layers)]
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits  # (2, L, V)
        logits, *presents = graph(ids, mask, torch.zeros(1, dtype=torch.long), *empty)
        assert all(p.shape == (2, spec.cache_heads, ids.shape[1], spec.head_dim) for p in presents)
        assert len(presents) == 2 * spec.layers
        valid = mask.bool()
        tol = EAGER_ATOL * min(1.0, ref.abs().max().item())
        assert (logits - ref)[valid].abs().max() < tol
        got, past = [], empty
        for t in range(prompt_len, ids.shape[1] + 1):
            start = 0 if t == prompt_len else t - 1
            step, *past = graph(ids[:, start:t], mask[:, :t], torch.ones(1, dtype=torch.long), *past)
            got.append(step)
    assert (torch.cat(got, dim=1) - ref[:, prompt_len - 1:]).abs().max() < tol


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tiny_graph_matches_transformers(tiny, flavour):
    _check_eager(tiny, flavour)


@pytest.mark.parametrize("name", sorted(RANDOM))
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_random_graphs_match_transformers(name, flavour):
    _check_eager(random_llama(**RANDOM[name]), flavour, prompt_len=4)


def test_the_sliding_window_is_in_the_graph():
    """Without its window the Mistral graph would differ from the model: the window test above can fail."""
    model = random_llama(**RANDOM["mistral_window"])
    ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        model.config.sliding_window = None
        graph = DecoderGraph(model, "plain")
        empty = [torch.zeros(2, 2, 0, 16) for _ in range(4)]
        unwindowed = graph(ids, mask, torch.zeros(1, dtype=torch.long), *empty)[0]
    assert (unwindowed - ref)[mask.bool()].abs().max() > 1e-3


# --- through onnxruntime (CPU provider)

def _check_ort(model, directory, flavour, prompt_len=8):
    """Prefill (all logits) and decode steps with past through OrtDecoder, against one PyTorch forward."""
    ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits  # (2, 12, V)
    dec = OrtDecoder(directory, "cpu", model=model, flavour=flavour)
    valid = mask.bool()
    assert (dec.logits(ids, mask) - ref)[valid].abs().max() < ATOL
    dec.start(2, 12)
    got = [dec.prefill(ids[:, :prompt_len], mask[:, :prompt_len]).clone()]
    for t in range(prompt_len, 12):
        got.append(dec.step(ids[:, t:t + 1]).clone())
    assert (torch.cat(got, dim=1) - ref[:, prompt_len - 1:]).abs().max() < ATOL


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tiny_ort_logits_match_pytorch(tiny, tiny_exports, flavour):
    _check_ort(tiny, tiny_exports[flavour][1], flavour)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_qwen2_ort_logits_match_pytorch(qwen2, qwen2_exports, flavour):
    _check_ort(qwen2, qwen2_exports[flavour][1], flavour, prompt_len=5)


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window_layer", "llama3_rope_head_dim", "llama_biases"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_random_ort_logits_match_pytorch(tmp_path, name, flavour):
    model = random_llama(**RANDOM[name])
    to_onnx(model, tmp_path / "x", flavour=flavour)
    _check_ort(model, tmp_path / "x", flavour, prompt_len=5)


def test_a_patched_model_exports_the_same_graph(tiny_llama_path, tmp_path):
    """A model patched by fuseinfer (fused q/k/v and gate/up, residual + RMSNorm modules) exports what the
    unpatched one computes."""
    import fuseinfer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    fuseinfer.patch(model)  # on the CPU every op runs its PyTorch reference
    assert type(model.model.layers[0].self_attn).__module__.startswith("fuseinfer")
    to_onnx(model, tmp_path / "x", flavour="fused")
    got = OrtDecoder(tmp_path / "x", "cpu", model=model).logits(ids, mask)
    assert (got - ref)[mask.bool()].abs().max() < ATOL


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_greedy_tokens_of_a_padded_batch_equal_generate(tiny, tiny_exports, flavour):
    """Greedy decoding through ORT (left-padded batch of 2, 16 tokens) gives generate's tokens."""
    ids, mask = _batch(tiny.config.vocab_size, length=10, seed=1)
    with torch.no_grad():
        ref = tiny.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, min_new_tokens=16,
                            pad_token_id=tiny.config.pad_token_id)[:, 10:]
    dec = OrtDecoder(tiny_exports[flavour][1], "cpu")
    dec.start(2, 26)
    tok = dec.prefill(ids, mask)[:, -1].argmax(-1, keepdim=True)  # (2, 1)
    out = [tok]
    for _ in range(15):
        tok = dec.step(tok)[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    assert torch.equal(torch.cat(out, dim=1), ref)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_chunk_after_the_past(tiny, tiny_exports, flavour):
    """Several new tokens over a past (chunked prefill): the plain graph takes a batch; the fused one a batch of 1
    (onnxruntime's GroupQueryAttention refuses multi-token steps over a past for larger batches)."""
    ids, mask = _batch(tiny.config.vocab_size)
    if flavour == "fused":
        ids, mask = ids[1:], mask[1:]
    b = ids.shape[0]
    with torch.no_grad():
        ref = tiny(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    dec = OrtDecoder(tiny_exports[flavour][1], "cpu")
    dec.start(b, 12)
    dec.prefill(ids[:, :6], mask[:, :6])
    out = torch.empty(b, 6, tiny.config.vocab_size)
    dec._run(ids[:, 6:], mask, dec.keep_all, out)  # the runtime's own binding, 6 tokens after 6
    assert (out - ref[:, 6:]).abs().max() < ATOL


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cpu_fp16_within_twice_pytorch_error(tiny_llama_path, tmp_path, flavour):
    """fp16 export on the CPU provider: within the project's tolerance rule against fp32 (check.py's figures:
    whole sequence and prefill + steps, left-padded)."""
    from transformers import AutoModelForCausalLM

    from fuseinfer.export.check import logit_errors, within_tolerance

    fp32 = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    fp16 = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float16).eval()
    to_onnx(fp16, tmp_path / "x", flavour=flavour)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, fp32.config.vocab_size, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    try:
        dec = OrtDecoder(tmp_path / "x", "cpu", model=fp16, flavour=flavour)
    except ExportError as exc:
        if "lack fp16 kernels" in str(exc):
            pytest.skip(f"this onnxruntime has no CPU fp16 kernels for the {flavour} graph: {exc}")
        raise
    errors = logit_errors(tmp_path / "x", fp32, fp16, "cpu", ids, mask, prompt_len=32, decoder=dec)
    assert errors["padded"] and within_tolerance(errors), errors


# --- what the graphs hold

def _contrib(directory):
    graph = onnx.load(str(directory / mf.MODEL_FILE), load_external_data=False).graph
    return graph, [n for n in graph.node if n.domain == CONTRIB]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_fused_graph_holds_the_contrib_ops_it_claims(tiny, tiny_exports):
    cfg, layers = tiny.config, tiny.config.num_hidden_layers
    for flavour, (manifest, directory) in tiny_exports.items():
        graph, contrib = _contrib(directory)
        found = {}
        for node in contrib:
            found[node.op_type] = found.get(node.op_type, 0) + 1
        assert found == manifest["contrib_ops"]
        if flavour == "plain":
            assert found == {} and all(n.domain in ("", "ai.onnx") for n in graph.node)
            assert not any("LayerNormalization" in n.op_type for n in graph.node)  # RMSNorm as standard ops
            continue
        assert found == {"GroupQueryAttention": layers, "RotaryEmbedding": 2 * layers,
                         "SkipSimplifiedLayerNormalization": 2 * layers,  # every residual add + RMSNorm, final
                         "FusedMatMul": 4 * layers + 1}  # q/k/v, o, gate/up, down per layer; the LM head
        gqa = [n for n in contrib if n.op_type == "GroupQueryAttention"][0]
        attrs = _attrs(gqa)
        assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["do_rotary"], attrs["local_window_size"]) == (
            cfg.num_attention_heads, cfg.num_key_value_heads, 0, -1)
        assert attrs["scale"] == pytest.approx(cfg.head_dim ** -0.5)
        rope_heads = [_attrs(n)["num_heads"] for n in contrib if n.op_type == "RotaryEmbedding"]
        assert rope_heads == [cfg.num_attention_heads, cfg.num_key_value_heads] * layers
        assert all(_attrs(n)["interleaved"] == 0 for n in contrib if n.op_type == "RotaryEmbedding")
        assert not any(n.op_type in ("Softmax", "MatMul") for n in graph.node)
        # the tied LM head reads the embedding table as stored: one (V, E) initializer, no transposed copy
        big = [i for i in graph.initializer if list(i.dims) == [cfg.vocab_size, cfg.hidden_size]]
        assert len(big) == 1


# The node types of the exported graphs (Constant nodes aside: exporter bookkeeping), pinned.
NODE_TYPES = {
    ("tiny", "fused"): {
        "Add": 1, "Cast": 7, "Clip": 1, "Concat": 1, "ConstantOfShape": 1, "CumSum": 1, "Div": 1, "Equal": 2,
        "Expand": 2, "Gather": 5, "Mul": 12, "Neg": 2, "Pow": 1, "ReduceMean": 1, "Reshape": 1, "Shape": 5,
        "Sigmoid": 4, "Slice": 3, "Split": 8, "Sqrt": 1, "Sub": 2, "Unsqueeze": 6, "Where": 1,
        "com.microsoft.FusedMatMul": 17, "com.microsoft.GroupQueryAttention": 4,
        "com.microsoft.RotaryEmbedding": 8, "com.microsoft.SkipSimplifiedLayerNormalization": 8},
    ("qwen2", "fused"): {  # two more Adds than the RMSNorm's epsilon: the q/k/v biases after their GEMM
        "Add": 3, "Cast": 5, "Clip": 1, "Concat": 1, "ConstantOfShape": 1, "CumSum": 1, "Div": 1, "Equal": 2,
        "Expand": 2, "Gather": 5, "Mul": 8, "Neg": 2, "Pow": 1, "ReduceMean": 1, "Reshape": 1, "Shape": 5,
        "Sigmoid": 2, "Slice": 3, "Split": 4, "Sqrt": 1, "Sub": 2, "Unsqueeze": 6, "Where": 1,
        "com.microsoft.FusedMatMul": 9, "com.microsoft.GroupQueryAttention": 2,
        "com.microsoft.RotaryEmbedding": 4, "com.microsoft.SkipSimplifiedLayerNormalization": 4},
    ("tiny", "plain"): {
        "Add": 26, "And": 1, "Cast": 60, "Clip": 1, "Concat": 64, "ConstantOfShape": 8, "CumSum": 1, "Div": 25,
        "Equal": 8, "Expand": 8, "Gather": 41, "Greater": 1, "LessOrEqual": 1, "MatMul": 37, "Mul": 78, "Neg": 2,
        "Pow": 9, "Range": 2, "ReduceMean": 9, "Reshape": 48, "Shape": 46, "Sigmoid": 4, "Slice": 18,
        "Softmax": 4, "Sqrt": 9, "Sub": 10, "Transpose": 20, "Unsqueeze": 145, "Where": 12},
}


def _node_types(manifest):
    return {k: v for k, v in manifest["op_counts"].items() if k != "Constant"}


def test_node_types_are_pinned(tiny_exports, qwen2_exports):
    assert _node_types(tiny_exports["fused"][0]) == NODE_TYPES["tiny", "fused"]
    assert _node_types(qwen2_exports["fused"][0]) == NODE_TYPES["qwen2", "fused"]
    plain = _node_types(tiny_exports["plain"][0])
    assert plain == NODE_TYPES["tiny", "plain"]
    # RMSNorm as Pow / ReduceMean / Add / Sqrt / Div / Mul: 2 per layer and the final one
    assert plain["Pow"] == plain["ReduceMean"] == plain["Sqrt"] == 2 * 4 + 1
    assert plain["Softmax"] == 4 and plain["MatMul"] == 4 * (3 + 1 + 3) + 4 * 2 + 1  # projections, QK, PV, head


@pytest.mark.parametrize("name, windows", [("mistral_window", [4, 4]), ("qwen2_window_layer", [-1, 4])])
def test_sliding_window_reaches_group_query_attention(tmp_path, name, windows):
    """Mistral's window on every layer; Qwen2's on the layers its layer_types make sliding."""
    model = random_llama(**RANDOM[name])
    to_onnx(model, tmp_path / "x", flavour="fused")
    _, contrib = _contrib(tmp_path / "x")
    assert [_attrs(n)["local_window_size"] for n in contrib if n.op_type == "GroupQueryAttention"] == windows


def test_manifest_kv_heads_are_checked(tiny_exports, tmp_path):
    """A manifest whose kv_heads is no head count is refused in one line; one without it (an older export) reads
    as multi-head."""
    manifest = dict(tiny_exports["fused"][0])
    for bad in (0, 5, "2"):
        manifest["model"] = {**tiny_exports["fused"][0]["model"], "kv_heads": bad}
        with pytest.raises(ExportError, match="kv_heads .* is not a head count"):
            mf.validate(manifest, tmp_path / mf.MANIFEST)
    del manifest["model"]["kv_heads"]
    mf.validate(manifest, tmp_path / mf.MANIFEST)
    assert mf.kv_heads(manifest) == manifest["model"]["heads"]


def test_manifest_names_the_kv_heads(tiny, tiny_exports):
    manifest, directory = tiny_exports["fused"]
    cfg = tiny.config
    assert manifest["model"]["kv_heads"] == cfg.num_key_value_heads and manifest["model"]["heads"] == 4
    past = [i for i in manifest["inputs"] if i["name"] == "past_key_0"][0]
    assert past["shape"] == ["batch", cfg.num_key_value_heads, "past_sequence", cfg.head_dim]
    assert "GroupQueryAttention" in manifest["attention"]
    assert "k / v repeated per query-head group" in tiny_exports["plain"][0]["attention"]
    assert manifest["model"]["config_hash"] == mf.config_hash(cfg)
    model = onnx.load(str(directory / mf.MODEL_FILE), load_external_data=False)
    dims = [d.dim_value or d.dim_param for d in
            next(i for i in model.graph.input if i.name == "past_value_3").type.tensor_type.shape.dim]
    assert dims[1] == cfg.num_key_value_heads and dims[3] == cfg.head_dim


def test_the_family_describes_the_graph(tiny):
    for kind in ("llama", "mistral", "qwen2"):
        fam = family(kind)
        assert set(fam.ort_matmul_kinds()) == {"qkv", "out", "mlp_in", "mlp_out", "head"}
        assert {"num_key_value_heads", "rope_parameters", "sliding_window"} <= set(fam.export_config_fields())
    spec = family("llama").export_spec(tiny)
    cfg = tiny.config
    assert (spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.hidden, spec.vocab, spec.max_positions) == (
        4, 4, 2, 64, 256, 8192, cfg.max_position_embeddings)
    assert DecoderGraph(tiny, "plain").spec == spec


def test_the_rope_is_part_of_the_config_hash():
    a = random_llama()
    b = random_llama(**RANDOM["llama_linear_rope"])
    assert mf.config_hash(a.config) != mf.config_hash(b.config)


# --- refusals: one clear message each, nothing written

def test_length_dependent_rope_is_refused(tmp_path):
    for rope in ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},):
        model = random_llama(rope_parameters=rope)
        with pytest.raises(ExportError, match="rope type 'dynamic' recomputes.*static rope type"):
            to_onnx(model, tmp_path / "x")
        assert not (tmp_path / "x").exists()


def test_model_without_lm_head_is_refused(tmp_path):
    with pytest.raises(ExportError, match="causal LMs.*AutoModelForCausalLM"):
        to_onnx(random_llama().model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_stale_export_is_refused(qwen2, qwen2_exports):
    directory = qwen2_exports["fused"][1]
    with pytest.raises(ExportError, match="another model configuration.*config hash"):
        OrtDecoder(directory, "cpu", model=random_llama(**{**RANDOM["qwen2"], "num_key_value_heads": 1}))
    with pytest.raises(ExportError, match="other weights.*weights hash"):
        OrtDecoder(directory, "cpu", model=random_llama(**RANDOM["qwen2"], seed=1))


# --- GPU: fp16 through the CUDA provider (GroupQueryAttention / RotaryEmbedding CUDA kernels)

@pytest.mark.gpu
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cuda_fp16_within_twice_pytorch_error(tiny_llama_path, tmp_path, flavour):
    from transformers import AutoModelForCausalLM

    from fuseinfer.export.check import logit_errors, within_tolerance
    from fuseinfer.export.ort_runtime import unavailable_reason

    reason = unavailable_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).cuda().eval()
    fp16 = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float16).cuda().eval()
    to_onnx(fp16, tmp_path / "x", flavour=flavour)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, fp32.config.vocab_size, (2, 40), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    dec = OrtDecoder(tmp_path / "x", "cuda", model=fp16, flavour=flavour)
    assert "CUDAExecutionProvider" in dec.session.get_providers()
    errors = logit_errors(tmp_path / "x", fp32, fp16, "cuda", ids, mask, prompt_len=32, decoder=dec)
    assert errors["padded"] and within_tolerance(errors), errors
