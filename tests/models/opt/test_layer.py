"""The OPT decoder layer written once (fuseinfer/models/opt/layer.py ``decoder_layer``): every runtime strategy that
runs it — the PyTorch reference, the patched modules, the lean prefill loop, the per-op decode forward, int8
weight-only (W8A16), SmoothQuant W8A8 and tensor parallel — gives transformers' OPT logits in fp32 on CPU, on the tiny
trained model and on a post-LN (opt-350m-like) random one; the int8 strategies against transformers' OPT holding the
dequantized weights (W8A8: its linears computed by the ops' int8 GEMM reference). And no other file under
fuseinfer/ writes the layer's math."""
from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from conftest import VARIANTS, random_opt
from helpers import cache_run

import fuseinfer
from fuseinfer import Int8WeightOnly, PatchConfig, SmoothQuantW8A8
from fuseinfer.models.opt.decode import forward_last_logits
from fuseinfer.models.opt.layer import TorchOps, decoder_layer
from fuseinfer.ops.quant import quantize_per_token
from fuseinfer.ops.w8a8_linear import w8a8_linear_ref
from fuseinfer.quant import smoothquant as sq
from fuseinfer.runtime import prefill as pf

ATOL = 1e-5  # absolute, on the logits
PACKAGE = Path(fuseinfer.__file__).parent


@pytest.fixture(scope="module", params=["tiny", "post_ln"])
def base(request, tiny_model_path):
    """The tiny trained OPT (pre-LN), or a random opt-350m-like one (post-LN, projected embeddings); fp32, eval."""
    if request.param == "post_ln":
        return random_opt(seed=0, **VARIANTS["post_ln_project_in_out"])
    from transformers import OPTForCausalLM

    return OPTForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _ids(model, rows=2, length=24):
    return torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _hf_last(model, ids, mask=None) -> torch.Tensor:
    """transformers' OPT (unpatched): fp32 logits of the last position (B, V)."""
    return model(input_ids=ids, attention_mask=mask).logits[:, -1].float()


def _close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=0, atol=ATOL)


@torch.no_grad()
def test_torch_ops_strategy_gives_transformers_logits(base):
    dec, ids = base.model.decoder, _ids(base)
    h = dec.embed_tokens(ids)
    if dec.project_in is not None:
        h = dec.project_in(h)
    h = h + dec.embed_positions(None, 0, position_ids=torch.arange(ids.shape[1]).expand(ids.shape))
    for i, layer in enumerate(dec.layers):
        h = decoder_layer(TorchOps(), i, layer, h, None, base.config.do_layer_norm_before)
    if dec.final_layer_norm is not None:
        h = dec.final_layer_norm(h)
    if dec.project_out is not None:
        h = dec.project_out(h)
    _close(base.lm_head(h).float(), base(input_ids=ids).logits.float())


def _runtime_paths_match(model, ref, ids, lean=True):
    """The patched modules (every position), the lean loop (left-padded too) and the per-op decode forward over a
    static cache against ``ref`` (transformers' OPT). ``lean``: whether ``fuseinfer.prefill`` takes the lean loop
    (else it runs the patched modules)."""
    assert (pf.lean_reason(model) is None) == lean
    with torch.no_grad():
        _close(model(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float())
    _close(fuseinfer.prefill(model, ids), _hf_last(ref, ids))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    _close(fuseinfer.prefill(model, ids, mask), _hf_last(ref, ids, mask))
    _close(cache_run(forward_last_logits, model, ids)[0], _hf_last(ref, ids))


def test_patched_modules_lean_loop_and_decode_forward_give_transformers_logits(base):
    model = copy.deepcopy(base)
    fuseinfer.patch(model)
    _runtime_paths_match(model, base, _ids(base))


def _dequantized_reference(base, quantized):
    """transformers' OPT with ``quantized``'s LayerNorms (SmoothQuant folds its factors into them) and its int8
    linears' dequantized weights (the fused q/k/v split back into q_proj, k_proj and v_proj)."""
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for r, q in zip(ref.model.decoder.layers, quantized.model.decoder.layers):
            for name in ("self_attn_layer_norm", "final_layer_norm"):
                getattr(r, name).load_state_dict(getattr(q, name).state_dict())
            qkv = q.self_attn._modules["qkv_proj"]
            w, b = qkv.dequantized_weight(torch.float32), qkv.bias
            e = w.shape[0] // 3
            for j, proj in enumerate((r.self_attn.q_proj, r.self_attn.k_proj, r.self_attn.v_proj)):
                proj.weight.copy_(w[j * e:(j + 1) * e])
                if b is not None:
                    proj.bias.copy_(b[j * e:(j + 1) * e])
            for rl, ql in ((r.self_attn.out_proj, q.self_attn.out_proj), (r.fc1, q.fc1), (r.fc2, q.fc2)):
                rl.weight.copy_(ql.dequantized_weight(torch.float32))
                if ql.bias is not None:
                    rl.bias.copy_(ql.bias)
    return ref


def test_w8a16_strategies_give_dequantized_transformers_logits(base):
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    _runtime_paths_match(model, _dequantized_reference(base, model), _ids(base))


def _int8_gemm(weight_q, weight_scale):
    """Forward hook: the linear's output as the W8A8 GEMM computes it, with the ops' references (on CPU the patched
    modules run them too): its input quantized per token, the exact int8 product, rescaled, plus the bias."""
    def hook(module, args, out):
        q, scale = quantize_per_token(args[0])
        return w8a8_linear_ref(q, scale, weight_q, weight_scale, module.bias, None, "none", torch.float32)

    return hook


def test_w8a8_strategies_give_transformers_logits_with_the_ops_int8_gemm(base):
    """transformers' OPT with the W8A8 model's LayerNorms (smoothed) and its linears computed by the ops' references
    (``_int8_gemm``): the W8A8 strategies' structure (which LayerNorm output is quantized for which GEMM, where the
    residual joins) against transformers' layer. (A fake-quantized fp32 reference, dequantized weights times
    dequantized activations, rounds its products and sums where the int8 GEMM is exact; those ~1e-7 relative
    differences move an activation across a rounding boundary of the next per-token quantization now and then, one
    int8 step, ~2e-3 on these logits: no bound that tight would be honest for it.) Both sides run SDPA's math kernel:
    the per-token quantization turns a one-ulp difference between SDPA's CPU kernels (transformers' causal call and
    the attention reference's masked one take different kernels on some CPUs, e.g. with AVX-512) into int8 steps."""
    with sdpa_kernel(SDPBackend.MATH):
        _w8a8_matches_int8_gemm_reference(base)


def _w8a8_matches_int8_gemm_reference(base):
    stats = sq.calibrate(base, ids=_ids(base, rows=1, length=256), samples=2, seq_len=128)
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats)))
    ref = _dequantized_reference(base, model)
    for r, q in zip(ref.model.decoder.layers, model.model.decoder.layers):
        qkv = q.self_attn._modules["qkv_proj"]
        e = qkv.weight_q.shape[0] // 3
        for j, proj in enumerate((r.self_attn.q_proj, r.self_attn.k_proj, r.self_attn.v_proj)):
            proj.register_forward_hook(_int8_gemm(qkv.weight_q[j * e:(j + 1) * e], qkv.weight_scale[j * e:(j + 1) * e]))
        for rl, ql in ((r.self_attn.out_proj, q.self_attn.out_proj), (r.fc1, q.fc1), (r.fc2, q.fc2)):
            rl.register_forward_hook(_int8_gemm(ql.weight_q, ql.weight_scale))
    _runtime_paths_match(model, ref, _ids(base))


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (tensor parallel of size 1: the all-reduces run, summing one
    rank)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_tensor_parallel_strategy_gives_transformers_logits(base, one_rank_group, monkeypatch):
    from fuseinfer.models.opt import tp
    from fuseinfer.parallel import tensor_parallel

    reduced = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(tp.dist, "all_reduce", lambda t, group=None: reduced.append(1) or all_reduce(t, group=group))
    model, ids = copy.deepcopy(base), _ids(base)
    tensor_parallel(model)
    assert all(type(layer) is tp.TPFusedOPTDecoderLayer for layer in model.model.decoder.layers)
    _runtime_paths_match(model, base, ids, lean=False)  # (the tensor-parallel layers run as modules)
    assert reduced  # (through TPOps)
    reduced.clear()
    fuseinfer.unpatch(model)  # the unfused tensor-parallel layers
    assert all(type(layer) is tp.TPOPTDecoderLayer for layer in model.model.decoder.layers)
    with torch.no_grad():
        _close(model(input_ids=ids).logits.float(), base(input_ids=ids).logits.float())
    assert len(reduced) == 2 * base.config.num_hidden_layers  # after out_proj and fc2 in each layer


def test_tp_ops_adds_the_residual_on_rank_0_only_and_reduces_the_row_parallel_linears(monkeypatch):
    """TPOps over TorchOps with a stub all-reduce: out_proj and fc2 get the residual on rank 0 only and are reduced;
    q/k/v (column-parallel, inside attention) and fc1 pass through."""
    from fuseinfer.models.opt import tp

    layer = random_opt(seed=0).model.decoder.layers[0]
    reduced = []
    monkeypatch.setattr(tp.dist, "all_reduce", lambda t, group=None: reduced.append(t))
    h = torch.randn(1, 5, layer.embed_dim)
    with torch.no_grad():
        for rank in (0, 1):
            reduced.clear()
            info = type("Info", (), {"rank": rank, "group": None})()
            out = decoder_layer(tp.TPOps(TorchOps(), layer, info), 0, layer, h, None, True)
            x, _ = TorchOps().norm(h, layer.self_attn_layer_norm)
            a = layer.self_attn.out_proj(TorchOps().attention(0, layer.self_attn, x, None))
            s = a + h if rank == 0 else a
            m = layer.fc2(torch.relu(layer.fc1(layer.final_layer_norm(s))))
            torch.testing.assert_close(out, m + s if rank == 0 else m)
            assert len(reduced) == 2 and reduced[-1] is out


# ---- the layer's math is written once ----

def _sources():
    # (every family's layer.py is its own decoder_layer: tests/models/<family>/ hold it to its model)
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "layer.py" or p.parent.parent.name != "models")


def test_no_other_file_calls_the_layers_submodules():
    """Outside models/opt/layer.py nothing calls a decoder layer's fc1 / fc2 / self_attn_layer_norm (``x.fc1(...)``):
    a path that runs the layer does it through ``decoder_layer`` with its strategy, which gets the submodules."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("fc1", "fc2", "self_attn_layer_norm"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_every_runtime_path_runs_decoder_layer():
    """The patched modules and the lean loop call ``decoder_layer`` (the decode forward calls the patched layers;
    tensor parallel wraps the modules' strategy), and it is defined once."""
    defs, calls = [], set()
    for path in _sources() + [PACKAGE / "models" / "opt" / "layer.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "decoder_layer":
                defs.append(path)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "decoder_layer":
                calls.add(path.relative_to(PACKAGE).as_posix())
    assert defs == [PACKAGE / "models" / "opt" / "layer.py"]
    assert {"models/opt/modules.py", "models/opt/lean.py"} <= calls


@pytest.mark.parametrize("package", ["runtime", "parallel"])
def test_runtime_and_parallel_reach_the_model_only_through_its_family(package):
    names = ("fc1", "fc2", "q_proj", "out_proj", "OPTDecoderLayer", "OPTAttention", "decoder.layers")
    found = [f"{p.relative_to(PACKAGE)}: {n}" for p in sorted((PACKAGE / package).rglob("*.py"))
             for n in names if n in p.read_text()]
    assert not found, found
