"""Runs every CUDA kernel once on small odd shapes; the target of compute-sanitizer in tools/gpu_check.sh.

    python tools/kernel_smoke.py [--part all|no-ring-wrap|sampling|sampling-cluster|ring-wrap-d64|ring-wrap-d128|
                                         prefill|prefill-fp8|int8-step]

``ring-wrap-d64`` and ``ring-wrap-d128`` are the one-kernel decode step with long contexts (head dim 64 and 128; d64
also the Llama family's step),
whose weight and key/value streams go round each block's ring of shared-memory stages many times;
``prefill`` is the attention prefills over enough key tiles to wrap the wgmma kernel's ring of TMA-filled stages,
and into a cache tail it zeroes after the TMA write, and the gate/up GEMM with SiLU(gate) * up in its epilogue (its
ring of TMA-filled stages read by wgmma only); ``prefill-fp8`` the FP8 prefill and its prep kernel (its consumers
read each Q tile from shared memory before the buffer's next TMA write); ``int8-step`` is the one-kernel step of int8 weight-only models
(int8 weight tiles through the ring: a short step per dtype and a long-context one whose ring wraps; racecheck it
through tools/racecheck_tma.py like the ring-wrap parts); ``sampling`` and ``sampling-cluster`` are the token-sampling
kernels (one block a row, and a cluster of blocks a row: slow under racecheck, so parts of their own that run beside
the others); ``no-ring-wrap`` is everything else. gpu_check's racecheck
gates the two decode parts on hazards other than a TMA write's (tools/racecheck_tma.py), since racecheck reports
the reuse of a TMA-filled stage even in a correct ring (tools/racecheck_ring.cu); each runs in its own process, so
that one's flood of reports does not use up racecheck's hazard records before the other runs. The other parts
must be free of hazards.
"""
import argparse

import torch
from transformers import OPTConfig, OPTForCausalLM

import fuseinfer
from fuseinfer import ops
from fuseinfer.core.knobs import override
from fuseinfer.ops.decode_step import decode_step_workspace, kernel_supports
from fuseinfer.models.opt.decode import decode_step_params, decode_step_weight_scales

parser = argparse.ArgumentParser()
parser.add_argument("--part", default="all",
                    choices=["all", "no-ring-wrap", "sampling", "sampling-cluster", "ring-wrap-d64", "ring-wrap-d128",
                             "prefill", "prefill-fp8", "int8-step"])
part = parser.parse_args().part
assert torch.cuda.is_available()
torch.manual_seed(0)


def attention(dtype, d, sq, skv, q_start=None, heads=3, kv_heads=None, modes=("wgmma", "mma_sync")):
    """Causal attention of 2 x `heads` query heads over `kv_heads` key/value heads (default: `heads`), with and
    without a key mask (row 1's first 11 keys masked); prefills (sq > 16) run once per mode: the wgmma kernel, the
    mma.sync one (FUSEINFER_ATTN_SM90=0) and the FP8 one (`fp8`: FUSEINFER_ATTN_FP8=1, its prep kernel too) on an
    sm_90a build."""
    q = torch.randn(2, heads, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, kv_heads or heads, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    key_mask = torch.arange(skv, device="cuda")[None] >= torch.tensor([0, 11], device="cuda")[:, None]
    qs = None if q_start is None else torch.full((2,), q_start, dtype=torch.int32, device="cuda")
    for mode in modes if sq > 16 else ("wgmma",):
        with override(ATTN_SM90="0" if mode == "mma_sync" else "1", ATTN_FP8="1" if mode == "fp8" else "0"):
            ops.attention(q, k, v, key_mask, qs, d ** -0.5)
            ops.attention(q, k, v, None, qs, d ** -0.5)
            if dtype != torch.float32:  # the 8-bit outputs (the prefills' epilogue; decode: the unfused pair)
                ops.attention_fp8out(q, k, v, key_mask, qs, d ** -0.5, torch.tensor([0.01], device="cuda"))
                ops.attention_int8out(q, k, v, key_mask, qs, d ** -0.5, torch.tensor([0.01], device="cuda"))


def other_kernels():
    """Every kernel but the one-kernel decode step."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x, r = torch.randn(37, 123, device="cuda", dtype=dtype), torch.randn(37, 123, device="cuda", dtype=dtype)
        w, b = torch.randn(123, device="cuda", dtype=dtype), torch.randn(123, device="cuda", dtype=dtype)
        ops.add_layer_norm(x, r, w, b, 1e-5, True)
        ops.add_layer_norm(torch.randn(5, 2048, device="cuda", dtype=dtype), None, None, None, 1e-5, False)
        # LayerNorm + int8 / e4m3 quantize: odd width (scalar path), warp-per-row and block-per-row widths, a row
        # whose scale leaves the fast division's range (weight 0, y = a tiny bias)
        for quant in (ops.add_layer_norm_quant, ops.add_layer_norm_quant_fp8):
            quant(x, r, w, b, 1e-5, True)
            quant(torch.randn(6, 1024, device="cuda", dtype=dtype), None, None, None, 1e-5, False)
            quant(torch.randn(5, 4096, device="cuda", dtype=dtype), None, None, None, 1e-5, True)
            quant(x, None, torch.zeros_like(w), torch.full_like(b, 1e-30 if dtype != torch.float16 else 0.0),
                  1e-5, False)
        # per-token e4m3 quantize: odd width (scalar path), 16-byte packs, a misaligned contiguous view, all-zero and
        # tiny rows (the exact division), more rows than the grid (grid-stride)
        ops.quantize_fp8_per_token(x)
        ops.quantize_fp8_per_token(torch.randn(6, 1024, device="cuda", dtype=dtype))
        ops.quantize_fp8_per_token(torch.randn(3 * 256 + 1, device="cuda", dtype=dtype)[1:].view(3, 256))
        ops.quantize_fp8_per_token(torch.cat([torch.zeros(2, 64, device="cuda", dtype=dtype),
                                              torch.full((2, 64), 1e-30 if dtype != torch.float16 else 1e-7,
                                                         device="cuda", dtype=dtype)]))
        ops.quantize_fp8_per_token(torch.randn(9000, 8, device="cuda", dtype=dtype))
        # RMSNorm: odd width (scalar path), a block-per-row width (vector path), a misaligned contiguous view
        ops.add_rms_norm(x, r, w, 1e-6, True)
        ops.add_rms_norm(torch.randn(5, 4096, device="cuda", dtype=dtype), None, None, 1e-6, False)
        ops.add_rms_norm(torch.randn(3 * 256 + 1, device="cuda", dtype=dtype)[1:].view(3, 256), None, None, 1e-6, True)
        # SiLU * up: odd F (scalar path), F % 8 == 0 (16-byte packs), a misaligned contiguous view
        ops.silu_mul(torch.randn(37, 2 * 123, device="cuda", dtype=dtype))
        ops.silu_mul(torch.randn(9, 2 * 1024, device="cuda", dtype=dtype))
        ops.silu_mul(torch.randn(2 * 2 * 64 + 1, device="cuda", dtype=dtype)[1:].view(2, 128))
    for dtype in (torch.float16, torch.bfloat16):
        x, w = torch.randn(19, 96, device="cuda", dtype=dtype), torch.randn(136, 96, device="cuda", dtype=dtype)
        b, r = torch.randn(136, device="cuda", dtype=dtype), torch.randn(19, 136, device="cuda", dtype=dtype)
        ops.linear_epilogue(x, w, b, None, "relu")
        ops.linear_epilogue(x, w, b, r, "none")
        ops.linear_epilogue(x[:1], w, b, r[:1], "none")
        # the GEMV with silu_mul in its epilogue (gate/up row pairs): one and two n-tiles, a K tail, F = 68 (not a
        # multiple of a tile's 8 outputs); fp16/bf16 and int8 weights
        for rows in (1, 11):
            ops.linear_epilogue(x[:rows], w, b, None, "silu_mul")
            ops.linear_epilogue(x[:rows], w, None, None, "silu_mul")
            qi, si = ops.quantize_per_channel(w.float())
            ops.w8a16_linear(x[:rows], qi, si.view(-1), b, None, "silu_mul")
        # the q/k/v GEMV with the rotary and the cache write in its epilogue: 3 q heads and 1 k/v head of D 32 (160
        # rows), one and two n-tiles, a K tail, a bias, a slot in and one past the cache (skipped); int8 weights too
        wr, br = torch.randn(160, 96, device="cuda", dtype=dtype), torch.randn(160, device="cuda", dtype=dtype)
        qr, sr = ops.quantize_per_channel(wr.float())
        for rows in (1, 11):
            ang = torch.rand(rows, 1, 16, device="cuda")
            cs, sn = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
            kc, vc = (torch.zeros(rows, 1, 7, 32, device="cuda", dtype=dtype) for _ in range(2))
            for slot in (6, 7):
                sl = torch.tensor([slot], device="cuda")
                ops.linear_rope_append(x[:rows, None], wr, None, br, cs, sn, 3, 1, kc, vc, sl)
                ops.linear_rope_append(x[:rows, None], qr, sr.view(-1), br, cs, sn, 3, 1, kc, vc, sl)
                ops.linear_rope_append(x[:rows, None], wr, None, br, None, None, 3, 1, kc, vc, sl)  # no rotation
        # K without a tail (the kernel that prefetches its rotary operands a tile ahead), with and without rotation
        xk, wk = torch.randn(11, 1, 128, device="cuda", dtype=dtype), torch.randn(160, 128, device="cuda", dtype=dtype)
        ang = torch.rand(11, 1, 16, device="cuda")
        cs, sn = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
        kc, vc = (torch.zeros(11, 1, 7, 32, device="cuda", dtype=dtype) for _ in range(2))
        for rows in (1, 11):
            sl = torch.tensor([6], device="cuda")
            ops.linear_rope_append(xk[:rows], wk, None, br, cs[:rows], sn[:rows], 3, 1, kc[:rows], vc[:rows], sl)
            ops.linear_rope_append(xk[:rows], wk, None, None, None, None, 3, 1, kc[:rows], vc[:rows], sl)
        # the GEMV with the RMSNorm prologue (rms_norm_linear, rms_norm_linear_rope_append): one and two n-tiles,
        # 1, 3 and 16 rows (warps per row: all, several, one), K with a tail (96) and without (128), every epilogue
        nw, nk = torch.randn(96, device="cuda", dtype=dtype), torch.randn(128, device="cuda", dtype=dtype)
        for rows in (1, 3, 16):
            xr = torch.randn(rows, 96, device="cuda", dtype=dtype)
            ops.rms_norm_linear(xr, nw, 1e-6, w, b, torch.randn(rows, 136, device="cuda", dtype=dtype), "none")
            ops.rms_norm_linear(xr, nw, 1e-6, w, b, None, "silu_mul")
            ops.rms_norm_linear(torch.randn(rows, 128, device="cuda", dtype=dtype), nk, 1e-6, wk, None, None,
                                "silu_mul")
            ang = torch.rand(rows, 1, 16, device="cuda")
            cs, sn = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
            kc, vc = (torch.zeros(rows, 1, 7, 32, device="cuda", dtype=dtype) for _ in range(2))
            sl = torch.tensor([6], device="cuda")
            ops.rms_norm_linear_rope_append(xr[:, None], nw, 1e-6, wr, br, cs, sn, 3, 1, kc, vc, sl)
            ops.rms_norm_linear_rope_append(torch.randn(rows, 1, 128, device="cuda", dtype=dtype), nk, 1e-6, wk,
                                            None, cs, sn, 3, 1, kc, vc, sl)
            ops.rms_norm_linear_rope_append(xr[:, None], nw, 1e-6, wr, None, None, None, 3, 1, kc, vc, sl)
        # the GEMV with the LayerNorm prologue (layer_norm_linear, layer_norm_linear_append): fp16 / bf16 and int8
        # weights, one and two n-tiles, 1, 3 and 16 rows, K with a tail and without (96 and 128 for the fp16 / bf16
        # GEMV; 96 and 256 for the int8 one, whose k-blocks are 128 wide), the plain (ReLU, residual) and the q/k/v
        # epilogue (3 q heads and 1 k/v head of D 32 here: the op takes any H, Hkv, as OPT's H = Hkv)
        lb, lbk = torch.randn(96, device="cuda", dtype=dtype), torch.randn(128, device="cuda", dtype=dtype)
        w256, wr256 = (torch.randn(n, 256, device="cuda", dtype=dtype) for n in (136, 160))
        n256, b256 = torch.randn(256, device="cuda", dtype=dtype), torch.randn(256, device="cuda", dtype=dtype)
        qw, sw = ops.quantize_per_channel(w.float())
        qw256, sw256 = ops.quantize_per_channel(w256.float())
        qr256, sr256 = ops.quantize_per_channel(wr256.float())
        for rows in (1, 3, 16):
            xr = torch.randn(rows, 96, device="cuda", dtype=dtype)
            xk2 = torch.randn(rows, 128, device="cuda", dtype=dtype)
            x256 = torch.randn(rows, 256, device="cuda", dtype=dtype)
            res = torch.randn(rows, 136, device="cuda", dtype=dtype)
            ops.layer_norm_linear(xr, nw, lb, 1e-5, w, None, b, res, "none")
            ops.layer_norm_linear(xk2, nk, lbk, 1e-5, wk, None, None, None, "relu")
            ops.layer_norm_linear(xr, nw, lb, 1e-5, qw, sw.view(-1), b, None, "relu")
            ops.layer_norm_linear(x256, n256, b256, 1e-5, qw256, sw256.view(-1), b, res, "none")
            kc, vc = (torch.zeros(rows, 1, 7, 32, device="cuda", dtype=dtype) for _ in range(2))
            sl = torch.tensor([6], device="cuda")
            ops.layer_norm_linear_append(xr[:, None], nw, lb, 1e-5, wr, None, br, 3, 1, kc, vc, sl)
            ops.layer_norm_linear_append(xk2[:, None], nk, lbk, 1e-5, wk, None, None, 3, 1, kc, vc, sl)
            ops.layer_norm_linear_append(xr[:, None], nw, lb, 1e-5, qr, sr.view(-1), br, 3, 1, kc, vc, sl)
            ops.layer_norm_linear_append(x256[:, None], n256, b256, 1e-5, qr256, sr256.view(-1), None, 3, 1, kc, vc,
                                         sl)
        # the e4m3 weight GEMV: one and two n-tiles, a K tail (K % 128 != 0), N not a multiple of 16
        wq, ws = ops.quantize_fp8_ref(torch.randn(136, 96, device="cuda"), -1)
        for rows in (1, 11):
            ops.fp8_weight_linear(x[:rows], wq, ws.view(-1), b, r[:rows], "none")
            ops.fp8_weight_linear(x[:rows], wq, ws.view(-1), b, None, "relu")
        for d in (64, 128):
            for sq, skv in ((77, 77), (1, 300), (4, 129)):
                attention(dtype, d, sq, skv)
        cache = torch.zeros(2, 3, 40, 64, device="cuda", dtype=dtype)
        kv = torch.randn(2, 3, 5, 64, device="cuda", dtype=dtype)
        ops.kv_cache_append(cache, cache.clone(), kv, kv, torch.tensor([3, 9, 10, 11, 39], device="cuda"))
        # beam reorder: rows 0 and 1 swap (read and written in one launch), row 3 stays; 16-byte and 2-byte units
        parent, one = torch.tensor([1, 0, 0, 3], device="cuda"), torch.ones(1, dtype=torch.long, device="cuda")
        for d in (64, 5):
            ops.kv_reorder(torch.randn(3, 2, 4, 2, 40, d, device="cuda", dtype=dtype), parent, one, one * 30, 36)


def fp8_caches(caches):
    """Keys and values (k0, v0, k1, v1, ...) -> (the same as e4m3 caches, each layer's (2, H) scales), as a prefill
    calibrates and writes them."""
    from fuseinfer.ops.kv_cache import kv_scales_from, quantize_kv

    scales = [kv_scales_from(k, v) for k, v in zip(caches[0::2], caches[1::2])]
    return [quantize_kv(c, scales[i // 2][i % 2]) for i, c in enumerate(caches)], scales


def decode_step(dtype, layers, hidden, heads, ffn, capacity, slots, pad, int8=False, fp8=False, kv8=False):
    """The one-kernel decode step of a random pre-LN OPT, one row per slot in ``slots`` (this step's cache
    slot), with the first ``pad`` keys of row 1 masked (left padding); ``int8``: quantized with Int8WeightOnly
    (the kernel's int8 weight stream), asserted to take the kernel; ``kv8``: over e4m3 caches."""
    cfg = OPTConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=ffn,
                    num_attention_heads=heads, max_position_embeddings=capacity + 2, word_embed_proj_dim=hidden)
    model = OPTForCausalLM(cfg).eval().to("cuda", dtype)
    quant = fuseinfer.Int8WeightOnly() if int8 else fuseinfer.Float8() if fp8 else None
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=quant) if quant is not None else None)
    int8 = int8 or fp8  # (the kernel's 8-bit weight stream, int8 or e4m3)
    dec, rows, d = model.model.decoder, len(slots), hidden // heads
    scales = decode_step_weight_scales(model)
    caches = [torch.randn(rows, heads, capacity, d, device="cuda", dtype=dtype) for _ in range(2 * layers)]
    caches, kv_scales = fp8_caches(caches) if kv8 else (caches, [])
    assert bool(scales) == int8 and kernel_supports(rows, dec.embed_tokens.weight, ffn, d, int8=int8,
                                                    kv_scales=2 * heads * layers if kv8 else 0)
    key_mask = torch.ones(rows, capacity, dtype=torch.bool, device="cuda")
    key_mask[1, :pad] = False
    tokens = torch.arange(5, 5 + rows, device="cuda")[:, None]
    q_start = torch.tensor(slots, dtype=torch.int32, device="cuda")
    positions = torch.tensor([[s - (pad if r == 1 else 0)] for r, s in enumerate(slots)], device="cuda")
    with torch.no_grad():
        ops.opt_decode_step(tokens, positions, q_start, key_mask, dec.embed_tokens.weight, dec.embed_positions.weight,
                            decode_step_params(model), caches[0::2], caches[1::2], dec.final_layer_norm.weight,
                            dec.final_layer_norm.bias, model.lm_head.weight,
                            decode_step_workspace(rows, hidden, ffn, heads, d, capacity, "cuda"), 1e-5, d ** -0.5,
                            scales, kv_scales)


def llama_decode_step(dtype, layers, hidden, heads, kv_heads, ffn, capacity, slots, pad, model_type="llama",
                      kv8=False):
    """The one-kernel decode step of a random Llama-architecture model (grouped-query: ``kv_heads``; Qwen2: a q/k/v
    bias), one row per slot in ``slots``, the first ``pad`` keys of row 1 masked; asserted to take the kernel;
    ``kv8``: over e4m3 caches."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fuseinfer.models.llama.decode import decode_step_params as llama_step_params
    from fuseinfer.ops import llama_step

    cfg = AutoConfig.for_model(model_type, vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers,
                               intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=capacity + 2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval().to("cuda", dtype)
    fuseinfer.patch(model)
    base, rows, d = model.model, len(slots), hidden // heads
    embed = base.embed_tokens.weight
    assert llama_step.kernel_supports(rows, embed, ffn, heads, kv_heads, d, 2 * kv_heads * layers if kv8 else 0)
    params, biases = llama_step_params(model)
    caches = [torch.randn(rows, kv_heads, capacity, d, device="cuda", dtype=dtype) for _ in range(2 * layers)]
    caches, kv_scales = fp8_caches(caches) if kv8 else (caches, [])
    key_mask = torch.ones(rows, capacity, dtype=torch.bool, device="cuda")
    key_mask[1, :pad] = False
    tokens = torch.arange(5, 5 + rows, device="cuda")
    q_start = torch.tensor(slots, dtype=torch.int32, device="cuda")
    positions = torch.tensor([[s - (pad if r == 1 else 0)] for r, s in enumerate(slots)], device="cuda")
    with torch.no_grad():
        cos, sin = base.rotary_emb(embed[:1], positions)  # (B, 1, D)
        ops.llama_decode_step(tokens, cos, sin, q_start, key_mask, embed, params, biases, caches[0::2],
                              caches[1::2], base.norm.weight, model.lm_head.weight,
                              decode_step_workspace(rows, hidden, ffn, heads, d, capacity, "cuda"),
                              base.layers[0].input_layernorm.variance_epsilon, d ** -0.5, kv_scales)


def emit_tokens(scores=None, chosen=None):
    """The decode step's tail: 3 rows over a vocabulary of 1001 (not a multiple of the kernel's chunks), one EOS;
    with ``chosen``, the one-block kernel that records those tokens."""
    scores = torch.randn(3, 1001, device="cuda") if scores is None else scores
    step = dict(tokens=torch.zeros(3, 1, dtype=torch.long), positions=torch.zeros(3, 1, dtype=torch.long),
                q_start=torch.zeros(3, dtype=torch.int32), decode_idx=torch.zeros(1, dtype=torch.long),
                step=torch.zeros(1, dtype=torch.long), unfinished=torch.ones(3, dtype=torch.bool),
                out=torch.zeros(3, 4, dtype=torch.long), alive=torch.ones(4, dtype=torch.bool))
    ops.emit_tokens(scores, torch.tensor([2], device="cuda"), 1, *(t.cuda() for t in step.values()),
                    ops.emit_tokens_scratch(3, "cuda"), chosen)


def _seed_off():
    return torch.tensor([5], device="cuda"), torch.tensor([2], device="cuda")


# temperature, top-k, top-p, min-p: no warper, top-k + top-p, top-p + min-p
_SAMPLING = ((1.0, 0, 1.0, 0.0), (0.7, 50, 0.9, 0.0), (1.3, 0, 0.95, 0.05))


def sample_tokens_one_block():
    """Sampling's token choice by the one-block kernel, each warper and ties at the cut-offs (fp16-rounded logits):
    a vocabulary of 1001 (the row in shared memory; odd, a tail past the Philox groups of four; the op's own pick,
    as at every size without sm_90) and 60013 (past the ~54k tokens a block keeps in shared memory: re-read from global memory; forced on sm_90,
    where the host would pick the cluster kernel); then the bookkeeping with the chosen tokens (emit_tokens'
    one-block kernel)."""
    from fuseinfer.core.extension import extension

    seed, off = _seed_off()
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    for v in (1001, 60013):
        scores = (torch.randn(3, v, device="cuda") * 3).half().float()
        scores[2, ::3] = float("-inf")
        for setting in _SAMPLING:
            if sm90:
                extension().sample_tokens_kept_with(scores, seed, off, *setting, 0)
            else:
                extension().sample_tokens_kept(scores, seed, off, *setting)
            if v == 1001 or not sm90:  # where the op's own pick is the one-block kernel
                chosen = ops.sample_tokens(scores, seed, off, *setting)
        if v == 1001:
            small, small_chosen = scores, chosen
    emit_tokens(small, small_chosen)


def sample_tokens_cluster():
    """The cluster sampling kernel (sm_90) at every cluster size (at 37 tokens and 16 CTAs six CTAs hold no token)
    and at 5003 tokens on 2 CTAs (several tokens a thread); a row of integers (ties at v*: the CTAs' tie cut).
    (Larger vocabularies take the same paths and run for many minutes under racecheck; the GPU tests cover them.)"""
    from fuseinfer.core.extension import extension

    if torch.cuda.get_device_capability()[0] < 9:
        return
    seed, off = _seed_off()
    for v, clusters in ((37, (2, 16)), (1001, (2, 4, 8, 16)), (5003, (2,))):
        scores = (torch.randn(3, v, device="cuda") * 3).half().float()
        scores[1] = torch.randint(-3, 4, (v,), device="cuda").float()
        scores[2, ::3] = float("-inf")
        for c in clusters:
            for setting in _SAMPLING + ((1.0, 5, 0.3, 0.0),):
                extension().sample_tokens_kept_with(scores, seed, off, *setting, c)
            torch.cuda.synchronize()
            print(f"sampling-cluster: vocab {v}, cluster {c} done", flush=True)


if part in ("all", "sampling"):
    sample_tokens_one_block()
if part in ("all", "sampling-cluster"):
    sample_tokens_cluster()
if part in ("all", "no-ring-wrap"):
    other_kernels()
    for dtype in (torch.float16, torch.bfloat16):
        decode_step(dtype, 2, 256, 4, 512, 96, [70, 50, 70], 20)  # short: a few stages per block
        llama_decode_step(dtype, 2, 256, 4, 2, 512, 96, [70, 50, 70], 20)  # the Llama step: d64, 2:1
    llama_decode_step(torch.float16, 2, 512, 4, 1, 512, 96, [70, 50], 20, model_type="qwen2")  # d128, 4:1, bias
    # e4m3 caches (4 attention items of D 64 per ring stage, 2 of D 128), both families
    decode_step(torch.float16, 2, 256, 4, 512, 96, [70, 50, 70], 20, kv8=True)
    decode_step(torch.bfloat16, 2, 512, 4, 512, 96, [70, 50], 20, kv8=True)  # d128
    llama_decode_step(torch.bfloat16, 2, 256, 4, 2, 512, 96, [70, 50, 70], 20, kv8=True)
    llama_decode_step(torch.float16, 2, 512, 4, 1, 512, 96, [70, 50], 20, model_type="qwen2", kv8=True)
    emit_tokens()
# contexts of 1100-1500 keys (several attention merge groups), rings wrapping many times
if part in ("all", "ring-wrap-d64"):
    decode_step(torch.float16, 4, 512, 8, 2048, 1536, [1100, 1500], 600)
    llama_decode_step(torch.bfloat16, 3, 512, 8, 2, 2048, 1536, [1100, 1500], 600)  # the Llama step, 4:1
if part in ("all", "ring-wrap-d128"):
    decode_step(torch.bfloat16, 4, 512, 4, 2048, 1536, [1499, 1100], 300)
if part in ("all", "int8-step"):
    for dtype in (torch.float16, torch.bfloat16):
        decode_step(dtype, 2, 256, 4, 512, 96, [70, 50, 70], 20, int8=True)
    decode_step(torch.float16, 3, 512, 4, 2048, 1536, [1499, 1100], 300, int8=True)  # d128, rings wrap
    decode_step(torch.bfloat16, 2, 256, 4, 512, 96, [70, 50, 70], 20, fp8=True)  # e4m3 weights
# prefills of 3-8 key tiles, where the wgmma kernel's ring of three TMA-filled stages wraps, and prefills into a
# cache whose keys past the chunk the kernel zeroes in its last tile (a generic write after the TMA write); the
# last one has more work items than an H100 has SMs, so blocks of the persistent kernel run several
if part in ("all", "prefill"):
    for dtype, d in ((torch.float16, 64), (torch.bfloat16, 128)):
        attention(dtype, d, 1000, 1000)
        attention(dtype, d, 300, 700, q_start=300)
        attention(dtype, d, 200, 400, q_start=100)
        attention(dtype, d, 300, 700, q_start=300, heads=60)


# ---- grouped-query attention (Hkv < H: split-KV packs a key/value head's query heads; the prefills index the shared
# head) and the fused rotary q/k/v split (every vector width: head dims 128, 80, 36, 6) ----
def rope_kernels():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (128, 80, 36, 6):
            h, hkv, s = 6, 2, 13
            qkv = torch.randn(2, s, (h + 2 * hkv) * d, device="cuda", dtype=dtype)
            cos, sin = (torch.randn(2, s, d, device="cuda", dtype=dtype) for _ in range(2))
            ops.qkv_rope(qkv, cos, sin, h, hkv)
            caches = [torch.zeros(2, hkv, 20, d, device="cuda", dtype=dtype) for _ in range(2)]
            slots = torch.tensor([0, 3, 19, 20, -1, 5, 6, 7, 8, 9, 10, 11, 12], device="cuda")  # two out of range
            ops.qkv_rope_append(qkv, cos, sin, h, hkv, *caches, slots)


# ---- the sm_90 CUTLASS scaled GEMMs with 8-bit output (fc1 writing fc2's input: e4m3 and int8) at each tile
# configuration's M, and the fp16/bf16-output FP8 one they sit beside; per-token and one-value x_scale ----
def scaled_gemms_8bit_out():
    from fuseinfer.ops.fp8_linear import fp8_linear, quantize_fp8_ref
    from fuseinfer.ops.linear_8bit_out import fp8_linear_fp8out, w8a8_linear_int8out
    from fuseinfer.ops.quant import quantize_int8_ref

    if torch.cuda.get_device_capability()[0] < 9:
        return
    for dtype in (torch.float16, torch.bfloat16):
        for m in (5, 200, 700):  # the small, medium and large configurations' M ranges (a partial last tile each)
            x, w = torch.randn(m, 256, device="cuda"), torch.randn(528, 256, device="cuda")
            b = torch.randn(528, device="cuda", dtype=dtype)
            scale = torch.tensor([0.05], device="cuda")
            for quantize, linear_8bit_out in ((quantize_fp8_ref, fp8_linear_fp8out),
                                              (quantize_int8_ref, w8a8_linear_int8out)):
                (xq, xs), (wq, ws) = quantize(x, -1), quantize(w, -1)
                linear_8bit_out(xq, xs, wq, ws.view(-1), b, scale, "relu")
                linear_8bit_out(xq, xs, wq, ws.view(-1), None, scale, "none")
                linear_8bit_out(xq, scale, wq, ws.view(-1), b, scale, "relu")  # one x_scale for every row
            xq, xs = quantize_fp8_ref(x, -1)
            wq, ws = quantize_fp8_ref(w, -1)
            fp8_linear(xq, xs, wq, ws.view(-1), b, torch.randn(m, 528, device="cuda", dtype=dtype), "relu", dtype)
            fp8_linear(xq, scale, wq, ws.view(-1), b, torch.randn(m, 528, device="cuda", dtype=dtype), "relu", dtype)


# ---- the FP8 (e4m3) KV cache: the appends (plain and fused with the rotary, every vector width, out-of-range slots)
# and decode attention over e4m3 keys and values (head dims 64 and 128, 1 to 8 rows per block, grouped-query heads,
# several splits) ----
def kv_fp8_kernels():
    from fuseinfer.ops.attention import attention_kv_fp8
    from fuseinfer.ops.kv_cache import FP8_DTYPE, kv_cache_append_fp8

    for dtype in (torch.float16, torch.bfloat16):
        for d in (128, 80, 36, 6):
            h, hkv, s = 6, 2, 13
            caches = [torch.zeros(2, hkv, 20, d, device="cuda", dtype=FP8_DTYPE) for _ in range(2)]
            scales = torch.rand(2, hkv, device="cuda") + 0.01
            slots = torch.tensor([0, 3, 19, 20, -1, 5, 6, 7, 8, 9, 10, 11, 12], device="cuda")  # two out of range
            qkv = torch.randn(2, s, (h + 2 * hkv) * d, device="cuda", dtype=dtype)
            cos, sin = (torch.randn(2, s, d, device="cuda", dtype=dtype) for _ in range(2))
            ops.qkv_rope_append(qkv, cos, sin, h, hkv, *caches, slots, scales)
            kv = qkv.view(2, s, h + 2 * hkv, d)[:, :, h:h + hkv].transpose(1, 2)  # (2, Hkv, S, D) strided
            kv_cache_append_fp8(*caches, kv, kv, slots, scales)
            kv_cache_append_fp8(*caches, kv, kv.contiguous(), slots, scales, calibrate=True)
        for d in (64, 128):
            for b, h, hkv, sq, skv in ((2, 12, 2, 1, 300), (3, 8, 8, 4, 129), (1, 32, 8, 1, 3000), (2, 4, 1, 16, 77),
                                       (3, 4, 4, 1, 1001), (2, 8, 4, 1, 333), (1, 2, 2, 2, 29)):  # 1, 2, 2 rows
                q = torch.randn(b, h, sq, d, device="cuda", dtype=dtype)
                k, v = (torch.randn(b, hkv, skv, d, device="cuda").to(FP8_DTYPE) for _ in range(2))
                key_mask = torch.rand(b, skv, device="cuda") > 0.1
                qs = torch.full((b,), skv - sq, dtype=torch.int32, device="cuda")
                attention_kv_fp8(q, k, v, key_mask, qs, d ** -0.5, torch.rand(2, hkv, device="cuda") + 0.01)


if part in ("all", "no-ring-wrap"):
    rope_kernels()
    kv_fp8_kernels()
    scaled_gemms_8bit_out()
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for sq, skv in ((77, 77), (1, 300), (4, 129), (16, 700)):
                attention(dtype, d, sq, skv, heads=12, kv_heads=2)  # 6 query heads per key/value head
            attention(dtype, d, 1, 3000, heads=32, kv_heads=8)  # decode with several splits (scratch, merge counters)
if part in ("all", "prefill"):
    # the sm_90 gate/up GEMM with silu_mul in its epilogue: partial row, column and k tiles, one partial k-block
    # (K 40); more tiles than SMs (CTAs walk several, the ring wraps across tiles)
    with override(SILU_GEMM="1"):
        for dtype, (m, f, k) in ((torch.float16, (300, 1000, 1040)), (torch.bfloat16, (1030, 4000, 264)),
                                 (torch.float16, (130, 1001, 64)), (torch.bfloat16, (70, 136, 40))):  # F 1001: scalar
            ops.linear_epilogue(torch.randn(m, k, device="cuda", dtype=dtype),
                                torch.randn(2 * f, k, device="cuda", dtype=dtype), None, None, "silu_mul")
    # the sm_90 q/k/v GEMM with the rotary, the split and the cache write in its epilogue: (B, S, H, Hkv, D, K, bias,
    # rotate): a partial row tile across batch rows, N 384 (a wholly out-of-bounds weight box), K 40, D 256 and 32, no
    # rotation with biases, more tiles than SMs; the last token's slot past the cache (skipped)
    for dtype, (b, s, h, hkv, d, k, bias, rot) in (
            (torch.float16, (3, 50, 4, 1, 64, 40, True, True)), (torch.bfloat16, (1, 17, 2, 1, 256, 264, False, True)),
            (torch.float16, (2, 130, 32, 32, 64, 256, True, False)), (torch.bfloat16, (2, 9, 8, 4, 32, 1040, True, True)),
            (torch.float16, (1, 1100, 32, 8, 128, 512, False, True))):
        n = (h + 2 * hkv) * d
        x = torch.randn(b, s, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        cs, sn = (torch.randn(b, s, d, device="cuda", dtype=dtype) for _ in range(2)) if rot else (None, None)
        kc, vc = (torch.randn(b, hkv, s + 2, d, device="cuda", dtype=dtype) for _ in range(2))
        sl = torch.arange(2, s + 2, device="cuda")
        sl[-1] = s + 2
        with override(QKV_GEMM="1"):
            ops.linear_rope_append(x, w, None, torch.randn(n, device="cuda", dtype=dtype) if bias else None, cs, sn, h,
                                   hkv, kc, vc, sl)
    for dtype, d in ((torch.float16, 64), (torch.bfloat16, 128)):
        attention(dtype, d, 300, 700, q_start=300, heads=8, kv_heads=2)  # the wgmma ring wraps, a cache tail to zero
        attention(dtype, d, 300, 700, q_start=300, heads=64, kv_heads=8)  # more work items than SMs
# the FP8 prefill and its prep: 1-8 key tiles per row (the ring of four stages wraps), a row end inside a tile and
# tiles past it (not written, not read), grouped-query heads, more work items than SMs
if part in ("all", "prefill-fp8"):
    for dtype, d in ((torch.float16, 64), (torch.bfloat16, 128)):
        attention(dtype, d, 1000, 1000, modes=("fp8",))
        attention(dtype, d, 300, 700, q_start=300, modes=("fp8",))
        attention(dtype, d, 300, 700, q_start=300, heads=8, kv_heads=2, modes=("fp8",))
        attention(dtype, d, 300, 700, q_start=300, heads=64, kv_heads=8, modes=("fp8",))
torch.cuda.synchronize()
print(f"kernel_smoke ({part}): all kernels ran")
