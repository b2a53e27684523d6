"""Tensor parallel for the Llama architecture on CPU: two processes over gloo shard the tiny trained Llama and small
random grouped-query Llama / Qwen2 / Mistral models, and must give the single-process patched model's logits and
greedy tokens (fused ops' references on CPU; and the unfused path after unpatch); every rank keeps whole key/value
heads (and a static cache of its own heads); a split that would cut a key/value head is refused on every rank."""
from __future__ import annotations

import copy
import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings, strategies as st

import fuseinfer
from conftest import TINY_LLAMA, random_llama
from fuseinfer.models import family

SIZE = 2
# name -> (model_type, config overrides): grouped-query 8/2 with Llama's o_proj / down_proj biases (added on rank 0
# only), Qwen2's q/k/v biases (split with their rows) at 4/2, Mistral at 8/4 (two key/value heads per rank)
RANDOM = {
    "llama_8_2_biases": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                                       mlp_bias=True)),
    "qwen2_4_2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral_8_4": ("mistral", dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)),
}


def _error(fn) -> str | None:
    try:
        fn()
    except fuseinfer.FuseInferError as exc:
        return str(exc)
    return None


def _left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return mask


def _case(model, ids, tied: bool) -> dict:
    """Shard ``model`` over the group and compare it with the same model in one process, patched and not."""
    from fuseinfer.parallel import tensor_parallel

    out = {}
    cfg = model.config
    mask = _left_padded(ids)
    with torch.no_grad():
        unpatched = model(ids, attention_mask=mask).logits
    reference = copy.deepcopy(model)
    fuseinfer.patch(reference)
    with torch.no_grad():
        patched = reference(ids, attention_mask=mask).logits
    report = tensor_parallel(model)
    out["report"] = str(report)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    out["shapes"] = {n: list(getattr(m, n).weight.shape) for m, names in
                     ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")))
                     for n in names}
    out["qkv_rows"] = attn.__dict__["qkv_weight"].shape[0]
    out["qkv_bias"] = [list(getattr(attn, n).bias.shape) for n in ("q_proj", "k_proj", "v_proj")
                       if getattr(attn, n).bias is not None]
    out["row_bias"] = [attn.o_proj.bias is not None, mlp.down_proj.bias is not None]
    out["attn_heads"] = [attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.config.head_dim]
    out["model_heads"] = [cfg.num_attention_heads, cfg.num_key_value_heads]
    out["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    out["tied_expected"] = tied
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    out["train"] = _error(lambda: model.train()(ids))  # (the original forward: no all-reduce)
    model.eval()
    out["scale"] = patched.abs().max().item()
    out["logits_err"] = (logits - patched).abs().max().item()
    out["vs_unpatched_err"] = (logits - unpatched).abs().max().item()
    gen = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=cfg.pad_token_id)
    want = fuseinfer.generate(reference, ids, mask, **gen)
    out["generate_equal"] = torch.equal(fuseinfer.generate(model, ids, mask, **gen), want)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, do_sample=False, **gen)
    out["hf_generate_equal"] = torch.equal(hf[:, ids.shape[1]:], want[:, ids.shape[1]:])
    session = next(iter(model._fuseinfer_sessions.values()))
    out["path"] = session.path
    out["cache_heads"] = session.cache.keys[0].shape[1]
    with torch.no_grad():
        out["copy_err"] = (copy.deepcopy(model)(ids, attention_mask=mask).logits - logits).abs().max().item()
    fuseinfer.unpatch(model)
    out["unpatched_class"] = type(model.model.layers[0]).__name__
    out["unpatched_heads"] = model.model.layers[0].self_attn.config.num_attention_heads
    with torch.no_grad():
        out["unfused_err"] = (model(ids, attention_mask=mask).logits - unpatched).abs().max().item()
    return out


def _worker(rank: int, size: int, init_file: str, out_dir: str, tiny: str | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    from fuseinfer.parallel import tensor_parallel

    result = {}
    # refusals first: every rank raises before anything changes, and the group stays usable
    one_kv = random_llama(num_attention_heads=4, num_key_value_heads=1)
    state = {k: v.clone() for k, v in one_kv.state_dict().items()}
    result["one_kv"] = _error(lambda: tensor_parallel(one_kv))
    result["one_kv_untouched"] = all(torch.equal(v, one_kv.state_dict()[k]) for k, v in state.items())
    result["three_kv"] = _error(lambda: tensor_parallel(random_llama(hidden_size=48, num_attention_heads=6,
                                                                        num_key_value_heads=3)))
    result["ffn"] = _error(lambda: tensor_parallel(random_llama(intermediate_size=97)))
    result["base_model"] = _error(lambda: tensor_parallel(random_llama().model))
    # the real thing
    torch.manual_seed(1)
    for name, (kind, overrides) in RANDOM.items():
        model = random_llama(kind, **overrides)
        ids = torch.randint(3, model.config.vocab_size, (2, 9))
        result[name] = _case(model, ids, tied=False)
    # int8 weight-only: each rank quantizes its shards (its own per-row scales over a row-parallel weight's columns)
    int8 = fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly())
    model = random_llama("qwen2", num_attention_heads=8, num_key_value_heads=2)
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    one = copy.deepcopy(model)
    fuseinfer.patch(one, int8)
    with torch.no_grad():
        exact = model(ids).logits
        result["int8_one_err"] = (one(ids).logits - exact).abs().max().item()
        report = tensor_parallel(model, config=int8)
        result["int8_tp_err"] = (model(ids).logits - exact).abs().max().item()
    result["int8_report"] = str(report)
    # built on the meta device, each rank drawing only its shards: the model random_model draws whole
    from fuseinfer.parallel import meta_model, random_init, random_model

    cfg = random_llama(num_attention_heads=8, num_key_value_heads=2).config
    whole = random_model(cfg, torch.float32, "cpu", seed=3)
    fuseinfer.patch(whole)
    meta = meta_model(cfg, torch.float32)
    tensor_parallel(meta, init=random_init(3))
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        want = whole(ids).logits
        result["meta_err"] = (meta(ids).logits - want).abs().max().item()
    result["meta_scale"] = want.abs().max().item()
    if tiny is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="sdpa").eval()
        ids = torch.randint(3, model.config.vocab_size, (2, 12))
        result["tiny"] = _case(model, ids, tied=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_llama")
    tiny = str(TINY_LLAMA) if (TINY_LLAMA / "config.json").exists() else None
    mp.spawn(_worker, args=(SIZE, str(tmp / "init"), str(tmp), tiny), nprocs=SIZE, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(SIZE)]


def _check_case(results, name, heads, kv_heads, ffn, hidden, head_dim, biases=(False, False), qkv_bias=False):
    h, kv, f = heads // SIZE, kv_heads // SIZE, ffn // SIZE
    for rank, r in enumerate(results):
        c = r[name]
        assert c["shapes"] == {"q_proj": [h * head_dim, hidden], "k_proj": [kv * head_dim, hidden],
                               "v_proj": [kv * head_dim, hidden], "o_proj": [hidden, h * head_dim],
                               "gate_proj": [f, hidden], "up_proj": [f, hidden], "down_proj": [hidden, f]}, name
        assert c["qkv_rows"] == (h + 2 * kv) * head_dim  # the fused q/k/v built from this rank's rows
        assert c["qkv_bias"] == ([[h * head_dim], [kv * head_dim], [kv * head_dim]] if qkv_bias else [])
        # a row-parallel bias lives on rank 0 only (added once by the all-reduce's sum)
        assert c["row_bias"] == ([b and rank == 0 for b in biases]), name
        assert c["attn_heads"] == [h, kv, head_dim] and c["model_heads"] == [heads, kv_heads]
        assert c["cache_heads"] == kv  # the static cache holds this rank's key/value heads
        assert c["tied"] == c["tied_expected"]
        # fp32: TP=2 sums the row-parallel products in another order than one process does
        tol = 2e-5 * max(1.0, c["scale"])
        assert c["logits_err"] < tol and c["vs_unpatched_err"] < tol, (name, c["logits_err"], c["scale"])
        assert c["unfused_err"] < tol and c["copy_err"] == 0.0, name
        assert c["generate_equal"] and c["hf_generate_equal"], name
        assert "tensor parallel" in c["path"]
        assert "runs in eval mode" in c["train"]
        assert f"TPFused{'Qwen2' if 'qwen2' in name else 'Mistral' if 'mistral' in name else 'Llama'}DecoderLayer" \
            in c["report"] and "Attention -> TPFused" in c["report"]
        assert f"{h} query and {kv} key/value heads and {f} MLP units per rank" in c["report"]
        assert c["unpatched_class"].startswith("TP") and c["unpatched_heads"] == h  # unpatch: unfused TP layers


def test_tp2_llama_gqa_8_2_with_row_biases(tp_results):
    _check_case(tp_results, "llama_8_2_biases", 8, 2, 96, 64, 8, biases=(True, True), qkv_bias=True)


def test_tp2_qwen2_biases_split_with_their_rows(tp_results):
    _check_case(tp_results, "qwen2_4_2", 4, 2, 96, 64, 16, qkv_bias=True)


def test_tp2_mistral_two_kv_heads_per_rank(tp_results):
    _check_case(tp_results, "mistral_8_4", 8, 4, 128, 64, 8)


def test_tp2_tiny_trained_llama(tp_results):
    if "tiny" not in tp_results[0]:
        pytest.skip(f"shared model not found at {TINY_LLAMA}; set FUSEINFER_SHARED to the shared/ folder")
    _check_case(tp_results, "tiny", 4, 2, 704, 256, 64)


def test_tp2_int8_weight_only(tp_results):
    for r in tp_results:
        assert "qkv_proj" in r["int8_report"] and "TPFusedQwen2Attention" in r["int8_report"]
        assert 0 < r["int8_tp_err"] <= 2 * r["int8_one_err"], (r["int8_tp_err"], r["int8_one_err"])


def test_tp2_from_the_meta_device(tp_results):
    for r in tp_results:
        # (random_init draws the RMSNorm weights near 0, so the logits are small: a relative bound)
        assert r["meta_scale"] > 1e-3 and r["meta_err"] < 1e-4 * r["meta_scale"]


def test_tp_refusals_raise_on_every_rank(tp_results):
    for r in tp_results:
        assert r["one_kv"].startswith("rank 0: num_key_value_heads=1 is not divisible by the tensor-parallel size 2")
        assert "use a tp size from [1]" in r["one_kv"] and r["one_kv_untouched"]
        assert "num_key_value_heads=3" in r["three_kv"] and "use a tp size from [1, 3]" in r["three_kv"]
        assert "intermediate_size=97 is not divisible by the tensor-parallel size 2" in r["ffn"]
        assert "takes a causal LM" in r["base_model"] and "got LlamaModel" in r["base_model"]


# ---- single process: the plan's arithmetic

@settings(max_examples=60, deadline=None)
@given(kv=st.integers(1, 8), group=st.integers(1, 4), ffn_units=st.integers(1, 6), size=st.integers(1, 8))
def test_tp_reason_accepts_exactly_the_sizes_it_names(kv, group, ffn_units, size):
    """tp_reason refuses a size iff it does not divide the key/value heads or the MLP width, and every size its
    message offers is accepted."""
    model = random_llama(num_attention_heads=kv * group, num_key_value_heads=kv, hidden_size=8 * kv * group,
                         intermediate_size=4 * ffn_units, num_hidden_layers=1, vocab_size=16)
    fam = family("llama")
    why = fam.tp_reason(model, size)
    assert (why is None) == (kv % size == 0 and (4 * ffn_units) % size == 0)
    if why is not None:
        offered = json.loads(why.rsplit("use a tp size from ", 1)[1])
        assert offered and all(fam.tp_reason(model, d) is None for d in offered)


@settings(max_examples=25, deadline=None)
@given(kv=st.sampled_from([1, 2, 4]), group=st.integers(1, 3), data=st.data())
def test_shards_keep_whole_kv_heads_and_the_query_heads_reading_them(kv, group, data):
    """Each rank's q/k/v slices (tp_shard_spec) hold whole heads, together they partition every column-parallel
    tensor, and each rank's query head j reads its own key/value head j // group: the global query head of that
    slot reads the global key/value head of that slot."""
    from fuseinfer.parallel.sharding import TPInfo

    size = data.draw(st.sampled_from([d for d in (1, 2, 4) if kv % d == 0]))
    d, heads = 4, kv * group
    q_rows = torch.arange(heads * d)  # row i of q_proj belongs to global query head i // d
    kv_rows = torch.arange(kv * d)
    seen_q, seen_kv = [], []
    for rank in range(size):
        spec = family("llama").tp_shard_spec(TPInfo(rank, size))
        for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.bias",
                     "model.layers.0.mlp.up_proj.weight"):
            assert spec(name) == (0, rank, size)
        assert spec("model.layers.1.self_attn.o_proj.weight") == (1, rank, size)
        assert spec("model.layers.1.mlp.down_proj.bias") == (None if rank == 0 else "drop")
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.input_layernorm.weight"):
            assert spec(name) is None
        dim, index, parts = spec("model.layers.0.self_attn.q_proj.weight")
        q = q_rows.chunk(parts)[index]
        k = kv_rows.chunk(parts)[index]
        assert len(q) % d == 0 and len(k) % d == 0  # whole heads
        local_q, local_kv = q.view(-1, d)[:, 0] // d, k.view(-1, d)[:, 0] // d  # global head of each local slot
        for j, global_head in enumerate(local_q.tolist()):
            assert local_kv[j // group].item() == global_head // group
        seen_q += q.tolist()
        seen_kv += k.tolist()
    assert seen_q == q_rows.tolist() and seen_kv == kv_rows.tolist()


def test_rank_config_reads_the_model_config_live():
    """The per-rank view of an attention module's config: its heads per rank, everything else (the attention
    implementation patch / unpatch switch) the model config's; the split sizes cannot be set through it."""
    from fuseinfer.models.llama.tp import RankConfig

    model = random_llama(num_attention_heads=8, num_key_value_heads=2)
    view = RankConfig(model.config, 2)
    assert (view.num_attention_heads, view.num_key_value_heads, view.head_dim) == (4, 1, 8)
    model.config._attn_implementation = "eager"
    assert view._attn_implementation == "eager" and view.hidden_size == 64
    view.output_attentions = True
    assert model.config.output_attentions
    with pytest.raises(fuseinfer.FuseInferError, match="fixed by the split"):
        view.num_attention_heads = 8


def test_tp_reason_refuses_what_patch_refuses():
    """A sliding window fuseinfer's attention does not implement is refused before anything is sharded (patch would
    refuse it only after every rank had placed its shards)."""
    fam = family("mistral")
    assert "sliding window of 16 tokens" in fam.tp_reason(random_llama("mistral", sliding_window=16), 2)
    assert fam.tp_reason(random_llama("mistral"), 2) is None


# ---- two GPUs, NCCL: the CUDA kernels on each rank's heads, the all-reduces captured in the decode graphs

def _gpu_worker(rank: int, size: int, port: int, out_dir: str, tiny: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    for knob in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):  # no NVLink multicast
        os.environ.setdefault(knob, "0" if knob == "NCCL_NVLS_ENABLE" else "1")
    from transformers import AutoModelForCausalLM

    from fuseinfer.parallel import init_distributed, tensor_parallel

    device = init_distributed()
    dtype = torch.float16

    def load(dt):
        return AutoModelForCausalLM.from_pretrained(tiny, dtype=dt, attn_implementation="sdpa").eval()

    ids = torch.randint(3, 8192, (3, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with torch.no_grad():
        ref32 = load(torch.float32)(ids, attention_mask=mask).logits  # (B, S, V) on the CPU
        one = load(dtype).to(device)
        torch16 = one(ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        fuseinfer.patch(one)
        gen = dict(max_new_tokens=12, min_new_tokens=12, pad_token_id=1)
        want = fuseinfer.generate(one, ids.to(device), mask.to(device), **gen).cpu()
        model = load(dtype)
        tensor_parallel(model, device=device)
        ours = model(ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        got = fuseinfer.generate(model, ids.to(device), mask.to(device), **gen).cpu()
    valid = mask.bool()  # padded positions' logits are not compared
    session = next(iter(model._fuseinfer_sessions.values()))
    result = {"ours_err": (ours - ref32)[valid].abs().max().item(),
              "torch_err": (torch16 - ref32)[valid].abs().max().item(), "tokens_equal": torch.equal(got, want),
              "cache_heads": session.cache.keys[0].shape[1], "path": session.path}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.gpu
def test_tp2_tiny_llama_on_two_gpus(tmp_path, tiny_llama_path):
    """TP=2 over NCCL in fp16: logits within twice torch's fp16 error of the fp32 reference, the greedy tokens (CUDA
    graph decode, all-reduces captured) those of the model patched on one GPU, a cache of one key/value head."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gpu_worker, args=(2, port, str(tmp_path), str(tiny_llama_path)), nprocs=2, join=True)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["ours_err"] <= 2 * r["torch_err"] + 1e-3, r
        assert r["tokens_equal"] and r["cache_heads"] == 1, r
        assert "tensor parallel" in r["path"] and "eager" not in r["path"], r["path"]  # CUDA graphs on

