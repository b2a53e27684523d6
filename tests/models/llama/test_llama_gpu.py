"""The Llama-architecture families on the GPU (fp16 and bf16): patched logits within the low-precision rule of the
fp32 model, greedy tokens of ``fuseinfer.generate`` and the patched ``model.generate`` equal transformers' with left
padding, WikiText-2 perplexity within 0.1% of eager (int8 weight-only within 0.5% of fp), CUDA-graph decode equal to
eager decode. Marked ``gpu``: skipped (and reported as skipped) without one."""
from __future__ import annotations

import pytest
import torch
from conftest import random_llama
from helpers import assert_lowp_close

import fuseinfer
from fuseinfer import Int8WeightOnly, PatchConfig, RuntimeConfig

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def _load(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def _ids(model, rows=4, length=24, seed=0):
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for r in range(rows):  # left padding of 0, 3, 6, ... tokens
        mask[r, :3 * r] = 0
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_patched_logits_within_the_low_precision_rule(tiny_llama_path, dtype):
    _assert_patched_within_the_low_precision_rule(_load(tiny_llama_path, torch.float32),
                                                  _load(tiny_llama_path, dtype), f"{dtype} logits")


def _assert_patched_within_the_low_precision_rule(ref32, lowp, what: str):
    """``lowp`` patched against its unpatched self, both against the fp32 model ``ref32``, on left-padded rows."""
    ids, mask = _ids(lowp)
    real = mask.bool()
    with torch.no_grad():
        ref = ref32(input_ids=ids, attention_mask=mask).logits[real]
        torch_lowp = lowp(input_ids=ids, attention_mask=mask).logits[real]
        fuseinfer.patch(lowp)
        ours = lowp(input_ids=ids, attention_mask=mask).logits[real]
    assert_lowp_close(ours, torch_lowp, ref, what, atol=1e-2)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_random_qwen2_and_mistral_logits_on_cuda(kind):
    """Random grouped-query models (head dim 64 and 128, Qwen2's q/k/v biases) through the kernels."""
    for heads, kv, hidden in ((8, 2, 512), (8, 2, 1024)):
        ref32 = random_llama(kind, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                             intermediate_size=2 * hidden, device="cuda")
        lowp = random_llama(kind, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                            intermediate_size=2 * hidden, device="cuda", dtype=torch.float16)
        _assert_patched_within_the_low_precision_rule(ref32, lowp, f"{kind} head dim {hidden // heads}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_greedy_tokens_equal_transformers_with_left_padding(tiny_llama_path, dtype):
    model = _load(tiny_llama_path, dtype)
    ids, mask = _ids(model, rows=4, length=16, seed=3)
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=1)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, **kwargs)
    fuseinfer.patch(model)
    ours = fuseinfer.generate(model, ids, mask, max_new_tokens=32, min_new_tokens=32, pad_token_id=1)
    ref32 = _load(tiny_llama_path, torch.float32)
    _assert_equal_up_to_near_ties(ours, ref, mask, ref32)
    with torch.no_grad():
        _assert_equal_up_to_near_ties(model.generate(ids, attention_mask=mask, **kwargs), ref, mask, ref32)


def _assert_equal_up_to_near_ties(ours, ref, mask, ref32, rel_gap: float = 0.02):
    """Greedy tokens equal transformers', or each row's first difference is a near-tie: the fp32 model scores the two
    tokens within ``rel_gap`` of its top logit's magnitude (bf16 rounds differently in the fused ops, and over 32
    steps a near-tie may flip; a real error picks a token the fp32 model ranks far lower)."""
    if torch.equal(ours, ref):
        return
    prompt = mask.shape[1]
    for r in range(ours.shape[0]):
        diff = (ours[r] != ref[r]).nonzero()
        if not len(diff):
            continue
        c = diff[0].item()
        assert c >= prompt, f"row {r}: the prompt itself differs at {c}"
        am = torch.cat([mask[r:r + 1], torch.ones(1, c - prompt, dtype=mask.dtype, device=mask.device)], 1)
        with torch.no_grad():
            logits = ref32(input_ids=ref[r:r + 1, :c], attention_mask=am).logits[0, -1]
        gap = (logits[ref[r, c]] - logits[ours[r, c]]).abs().item()
        assert gap <= rel_gap * logits.abs().max().item(), (
            f"row {r} token {c - prompt}: ours {ours[r, c].item()} vs {ref[r, c].item()}, fp32 logit gap {gap:.4f}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_cuda_graph_decode_equals_eager_decode(tiny_llama_path, dtype):
    from fuseinfer.runtime.cache import COUNTS

    model = _load(tiny_llama_path, dtype)
    ids, mask = _ids(model, rows=3, length=20, seed=4)
    fuseinfer.patch(model, PatchConfig(runtime=RuntimeConfig(cuda_graphs=False)))
    eager = fuseinfer.generate(model, ids, mask, max_new_tokens=40, min_new_tokens=40, pad_token_id=1)
    fuseinfer.unpatch(model)
    before = COUNTS["decode_graphs"]
    fuseinfer.patch(model, PatchConfig(runtime=RuntimeConfig(cuda_graphs=True)))
    graphs = fuseinfer.generate(model, ids, mask, max_new_tokens=40, min_new_tokens=40, pad_token_id=1)
    assert COUNTS["decode_graphs"] > before  # (the graphs ran)
    assert torch.equal(graphs, eager)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_wikitext2_perplexity_within_a_tenth_of_a_percent_on_cuda(tiny_llama_path, dtype):
    from tests.models.llama.test_family import _perplexities

    eager, patched = _perplexities(_load(tiny_llama_path, dtype), tiny_llama_path, windows=24, device="cuda")
    print(f"llama-wt2-tiny {dtype} WikiText-2 PPL (24 windows of 512): eager {eager:.4f}, patched {patched:.4f}")
    assert abs(patched / eager - 1) < 1e-3


def test_fp8_attention_perplexity_on_cuda(tiny_llama_path, set_knob):
    """fp16 weights with the FP8 prefill attention (FUSEINFER_ATTN_FP8=1, grouped-query heads): WikiText-2
    perplexity within 0.5% of the fp16 model's."""
    from helpers import paths_taken, wgmma_available
    from tests.models.llama.test_family import _perplexities

    if not wgmma_available():
        pytest.skip("the FP8 prefill attention needs an sm_90 GPU")
    eager, patched = _perplexities(_load(tiny_llama_path, torch.float16), tiny_llama_path, windows=24, device="cuda")
    set_knob("FUSEINFER_ATTN_FP8", "1")
    (_, fp8), paths = paths_taken(lambda: _perplexities(_load(tiny_llama_path, torch.float16), tiny_llama_path,
                                                       windows=24, device="cuda"))
    print(f"llama-wt2-tiny fp16 WikiText-2 PPL (24 windows of 512): patched {patched:.4f}, FP8 attention {fp8:.4f}"
          f" ({100 * (fp8 / patched - 1):+.3f}%)")
    assert paths.get("attention.wgmma_fp8", 0) > 0
    assert abs(fp8 / patched - 1) < 0.005


def test_int8_weight_only_perplexity_on_cuda(tiny_llama_path):
    from tests.models.llama.test_family import _perplexities

    fp, w8 = _perplexities(_load(tiny_llama_path, torch.float16), tiny_llama_path, windows=24,
                           quant=Int8WeightOnly(), device="cuda")
    print(f"llama-wt2-tiny fp16 WikiText-2 PPL (24 windows of 512): fp16 {fp:.4f}, W8A16 {w8:.4f}")
    assert abs(w8 / fp - 1) < 0.005


def test_int8_weight_only_fast_decode_on_cuda(tiny_llama_path):
    """The int8 model decodes in CUDA graphs as eagerly (the W8A16 GEMV at decode, the fused q/k/v and gate/up)."""
    model = _load(tiny_llama_path, torch.float16)
    ids, mask = _ids(model, rows=2, length=12, seed=5)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(keep_original="cpu"),
                                       runtime=RuntimeConfig(cuda_graphs=False)))
    eager = fuseinfer.generate(model, ids, mask, max_new_tokens=24, min_new_tokens=24, pad_token_id=1)
    fuseinfer.unpatch(model)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=24, min_new_tokens=24, pad_token_id=1),
                       eager)


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_decode_gemv_epilogues_change_no_token(tiny_llama_path, dtype, quant, set_knob):
    """The decode GEMVs with silu_mul and the rotary + cache write in their epilogues (one kernel each) against the
    same model with FUSEINFER_GEMV_EPILOGUES=0 (the GEMV, then silu_mul / qkv_rope_append): the same tokens, and
    one decode step's logits bit for bit (the fused kernels round as the pairs do; the tiny model has no biases)."""
    from fuseinfer.core.extension import extension

    model = _load(tiny_llama_path, dtype)
    ids, mask = _ids(model, rows=3, length=20, seed=6)
    config = PatchConfig(quant=Int8WeightOnly(keep_original="cpu") if quant else None)
    runs = {}
    for fused in ("1", "0"):
        set_knob("FUSEINFER_GEMV_EPILOGUES", fused)
        fuseinfer.patch(model, config)
        before = extension().path_counts()["linear.skinny"]
        tokens = fuseinfer.generate(model, ids, mask, max_new_tokens=24, min_new_tokens=24, pad_token_id=1)
        if quant is None:
            assert extension().path_counts()["linear.skinny"] > before  # (the GEMVs ran)
        with torch.no_grad():  # one cached decode step through the patched modules (eager: the knob read per call)
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            step = model(input_ids=tokens[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                         past_key_values=out.past_key_values).logits
        runs[fused] = tokens, step
        fuseinfer.unpatch(model)
    assert torch.equal(runs["1"][0], runs["0"][0])
    assert torch.equal(runs["1"][1], runs["0"][1])
