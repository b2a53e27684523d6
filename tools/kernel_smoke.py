"""Runs every CUDA kernel once on small odd shapes; the target of compute-sanitizer in tools/gpu_check.sh."""
import torch
from transformers import OPTConfig, OPTForCausalLM

import fuseinfer
from fuseinfer import ops
from fuseinfer.ops.decode_step import decode_step_workspace
from fuseinfer.patches.opt import decode_step_params

assert torch.cuda.is_available()
torch.manual_seed(0)
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    x, r = torch.randn(37, 123, device="cuda", dtype=dtype), torch.randn(37, 123, device="cuda", dtype=dtype)
    w, b = torch.randn(123, device="cuda", dtype=dtype), torch.randn(123, device="cuda", dtype=dtype)
    ops.add_layer_norm(x, r, w, b, 1e-5, True)
    ops.add_layer_norm(torch.randn(5, 2048, device="cuda", dtype=dtype), None, None, None, 1e-5, False)
for dtype in (torch.float16, torch.bfloat16):
    x, w = torch.randn(19, 96, device="cuda", dtype=dtype), torch.randn(136, 96, device="cuda", dtype=dtype)
    b, r = torch.randn(136, device="cuda", dtype=dtype), torch.randn(19, 136, device="cuda", dtype=dtype)
    ops.linear_epilogue(x, w, b, None, "relu")
    ops.linear_epilogue(x, w, b, r, "none")
    ops.linear_epilogue(x[:1], w, b, r[:1], "none")
    for d in (64, 128):
        for sq, skv in ((77, 77), (1, 300), (4, 129)):
            q = torch.randn(2, 3, sq, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(2, 3, skv, d, device="cuda", dtype=dtype) for _ in range(2))
            key_mask = torch.arange(skv, device="cuda")[None] >= torch.tensor([0, 11], device="cuda")[:, None]
            ops.attention(q, k, v, key_mask, None, d ** -0.5)
            ops.attention(q, k, v, None, None, d ** -0.5)
    cache = torch.zeros(2, 3, 40, 64, device="cuda", dtype=dtype)
    kv = torch.randn(2, 3, 5, 64, device="cuda", dtype=dtype)
    ops.kv_cache_append(cache, cache.clone(), kv, kv, torch.tensor([3, 9, 10, 11, 39], device="cuda"))

# the one-kernel decode step: a 2-layer random pre-LN OPT, 3 rows (one left-padded), cache of 96 slots
for dtype in (torch.float16, torch.bfloat16):
    cfg = OPTConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, ffn_dim=512, num_attention_heads=4,
                    max_position_embeddings=256, word_embed_proj_dim=256)
    model = OPTForCausalLM(cfg).eval().to("cuda", dtype)
    fuseinfer.patch(model)
    dec = model.model.decoder
    caches = [torch.randn(3, 4, 96, 64, device="cuda", dtype=dtype) for _ in range(4)]
    key_mask = torch.ones(3, 96, dtype=torch.bool, device="cuda")
    key_mask[1, :20] = False
    tokens, positions = torch.tensor([[5], [6], [7]], device="cuda"), torch.tensor([[70], [50], [70]], device="cuda")
    q_start = torch.full((3,), 70, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        ops.opt_decode_step(tokens, positions, q_start, key_mask, dec.embed_tokens.weight, dec.embed_positions.weight,
                            decode_step_params(model), caches[0::2], caches[1::2], dec.final_layer_norm.weight,
                            dec.final_layer_norm.bias, model.lm_head.weight,
                            decode_step_workspace(3, 256, 512, 4, 64, 96, "cuda"), 1e-5, 0.125)
# the decode step's tail: 3 rows over a vocabulary of 1001 (not a multiple of the kernel's chunks), one EOS
scores = torch.randn(3, 1001, device="cuda")
step = dict(tokens=torch.zeros(3, 1, dtype=torch.long), positions=torch.zeros(3, 1, dtype=torch.long),
            q_start=torch.zeros(3, dtype=torch.int32), decode_idx=torch.zeros(1, dtype=torch.long),
            step=torch.zeros(1, dtype=torch.long), unfinished=torch.ones(3, dtype=torch.bool),
            out=torch.zeros(3, 4, dtype=torch.long), alive=torch.ones(4, dtype=torch.bool))
ops.emit_tokens(scores, torch.tensor([2], device="cuda"), 1, *(t.cuda() for t in step.values()),
                ops.emit_tokens_scratch(3, "cuda"))
torch.cuda.synchronize()
print("kernel_smoke: all kernels ran")
