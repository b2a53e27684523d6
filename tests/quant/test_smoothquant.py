"""SmoothQuant: smoothing is exact in fp32 (pre-LN and the post-LN subset), calibration statistics save and load,
bad input leaves the model untouched with one clear message, and the outlier test: on the tiny trained OPT with
outlier channels, naive W8A8 loses >= 20% perplexity while SmoothQuant stays within 2% of the unquantized model
(CPU reference path in CI; the same on the GPU kernels under @pytest.mark.gpu)."""
from __future__ import annotations

import copy

import pytest
import torch

from fuseinfer import FuseInferError
from fuseinfer.quant import smoothquant as sq
from conftest import WIKITEXT, random_opt
from helpers import assert_same_state, state

SEQ_LEN, WINDOWS = 2048, 2        # GPTQ protocol windows of the tiny model's full context, a few to stay fast
CAL_SAMPLES, CAL_SEQ_LEN = 8, 512  # calibration on the validation split


def fake_stats(model, seed=0, outliers=True):
    """Calibration-like maxima for every calibrated input, a few channels 50x larger."""
    g = torch.Generator().manual_seed(seed)
    act = {}
    for name, m in sq._linear_names(model):
        a = torch.rand(m.in_features, generator=g) + 0.1
        if outliers:
            a[:3] *= 50
        act[name] = a
    return sq.CalibrationStats(act, 1, 8, "fake")


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln"])
def test_smoothing_keeps_fp32_logits(variant):
    overrides = {} if variant == "pre_ln" else dict(do_layer_norm_before=False)
    model = random_opt(seed=1, **overrides)
    ids = torch.randint(3, 512, (2, 24))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = sq.smooth(model, fake_stats(model), alpha=0.5)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    layers = model.config.num_hidden_layers
    if variant == "pre_ln":
        assert len(report.smoothed) == 4 * layers and not report.skipped
    else:  # opt-350m's layout: only the inputs behind fc1 and v_proj; the LayerNorm ones skipped, with the reason
        assert {g.kind for g in report.smoothed} == {"linear_rows"} and len(report.smoothed) == 2 * layers
        assert len(report.skipped) == 2 * layers and "residual stream" in report.skipped[0][1]
        assert "residual stream" in report.summary()


def test_smoothing_flattens_the_outliers():
    """After smoothing, the activation range the quantizer sees (max|X_j| / s_j) is sqrt(max|X| max|W|) per channel at
    alpha = 0.5: the 50x outlier channels come down to the others' scale."""
    model = random_opt(seed=2)
    stats = fake_stats(model)
    report = sq.smooth(model, stats, 0.5)
    key = next(k for k in report.factors if k.endswith("q_proj"))
    smoothed = stats.act_max[key] / report.factors[key]
    assert smoothed.max() / smoothed.median() < (stats.act_max[key].max() / stats.act_max[key].median()) / 5


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), "0.5", True])
def test_bad_alpha_leaves_model_untouched(alpha):
    model = random_opt(seed=3)
    before = state(model)
    with pytest.raises(FuseInferError, match=r"alpha must be a number in \[0, 1\]"):
        sq.smooth(model, fake_stats(model), alpha)
    assert_same_state(model, before)


def test_stats_of_another_model_are_refused_untouched():
    model = random_opt(seed=4)
    other = random_opt(seed=4, hidden_size=96, num_attention_heads=4, ffn_dim=200)
    before = state(model)
    with pytest.raises(FuseInferError, match="calibrate this model"):
        sq.smooth(model, fake_stats(other), 0.5)
    missing = fake_stats(model)
    missing.act_max.pop(next(iter(missing.act_max)))
    with pytest.raises(FuseInferError, match="another model; calibrate this one"):
        sq.smooth(model, missing, 0.5)
    assert_same_state(model, before)


def test_no_calibration_data_names_the_flag(no_wikitext, tmp_path):
    with pytest.raises(FuseInferError, match="--calibration-data"):
        sq.calibration_text()
    with pytest.raises(FuseInferError, match="--calibration-data.*wiki.valid.raw"):
        sq.calibration_text(tmp_path)  # a folder without the file
    (tmp_path / "wiki.test.raw").write_text("x\n")
    with pytest.raises(FuseInferError, match="test split"):
        sq.calibration_text(tmp_path / "wiki.test.raw")


def test_text_shorter_than_one_sample():
    with pytest.raises(FuseInferError, match="shorter than one calibration sample of 512"):
        sq.calibration_samples(torch.arange(100)[None], 4, 512)
    windows = sq.calibration_samples(torch.arange(5000)[None], 4, 512)
    assert len(windows) == 4 and all(w.shape == (1, 512) for w in windows)
    starts = [int(w[0, 0]) for w in windows]
    assert starts == sorted(set(starts)) and starts[-1] + 512 <= 5000  # spread, distinct, inside the text


def test_calibrate_records_every_input_and_round_trips(tmp_path):
    model = random_opt(seed=5)
    before = state(model)
    stats = sq.calibrate(model, ids=torch.randint(3, 512, (1, 300)), samples=3, seq_len=64)
    assert_same_state(model, before)  # calibration only runs the model
    names = {n for n, _ in sq._linear_names(model)}
    assert stats.act_max.keys() == names and stats.samples == 3
    assert all((v > 0).all() for v in stats.act_max.values())
    stats.save(tmp_path / "cal.safetensors")
    loaded = sq.CalibrationStats.load(tmp_path / "cal.safetensors")
    assert loaded.samples == 3 and loaded.seq_len == 64 and loaded.meta["layers"] == 2
    for k, v in stats.act_max.items():
        assert torch.equal(loaded.act_max[k], v)
    with pytest.raises(FuseInferError, match="not found"):
        sq.CalibrationStats.load(tmp_path / "missing.safetensors")


def test_outlier_model_keeps_its_function():
    model = random_opt(seed=6)
    ids = torch.randint(3, 512, (1, 32))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        sq.add_outlier_channels(model, channels=4, factor=300.0)
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-3)
    with pytest.raises(FuseInferError, match="pre-LN"):
        sq.add_outlier_channels(random_opt(seed=6, do_layer_norm_before=False))


def test_quantized_model_runs_and_refuses_a_second_quantization():
    model = random_opt(seed=7)
    names = sq.quantize_linears_w8a8(model)
    assert len(names) == 6 * model.config.num_hidden_layers
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(3, 512, (1, 16))).logits).all()
    with pytest.raises(FuseInferError, match="already quantized"):
        sq.quantize_linears_w8a8(model)


# ------------------------------------------------------------------------------------------- the outlier test

def _ppl(model, windows, device):
    from fuseinfer.harness.perplexity import perplexity

    with torch.no_grad():
        return perplexity(lambda i, l: model(input_ids=i, labels=l).loss, windows, device).ppl


def _outlier_experiment(tiny_model_path, device, dtype):
    """(ppl of the outlier model unquantized, naive W8A8, SmoothQuant W8A8), all on ``device`` in ``dtype``."""
    from transformers import AutoTokenizer, OPTForCausalLM

    from fuseinfer.harness.data import load_eval_text, tokenize
    from fuseinfer.harness.perplexity import gptq_windows

    if not (WIKITEXT / "wiki.test.raw").is_file() or not (WIKITEXT / sq.CALIBRATION_FILE).is_file():
        pytest.skip(f"WikiText-2 raw files not found in {WIKITEXT}; set FUSEINFER_SHARED")
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    base = OPTForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    sq.add_outlier_channels(base, channels=4, factor=300.0)  # in fp32, then cast
    base = base.to(device=device, dtype=dtype)
    windows = gptq_windows(tokenize(tok, load_eval_text(str(WIKITEXT)).text), SEQ_LEN, WINDOWS)
    stats = sq.calibrate(base, tok, data_dir=WIKITEXT, samples=CAL_SAMPLES, seq_len=CAL_SEQ_LEN)
    assert stats.source.endswith("wiki.valid.raw")
    ppl_fp = _ppl(base, windows, device)
    naive = copy.deepcopy(base)
    sq.smoothquant_reference(naive, None)
    ppl_naive = _ppl(naive, windows, device)
    smoothed = base
    sq.smoothquant_reference(smoothed, stats, alpha=0.5)
    ppl_smooth = _ppl(smoothed, windows, device)
    return ppl_fp, ppl_naive, ppl_smooth


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.float16, marks=pytest.mark.gpu)])
def test_smoothquant_matters_on_the_outlier_model(tiny_model_path, device, dtype):
    """The outlier test: on the CPU the reference path (fp32 activations, exact int8 GEMMs); on the GPU fp16,
    every W8A8 linear running the sm90 kernel (or the documented fallback elsewhere)."""
    from fuseinfer.ops.w8a8_linear import w8a8_backend

    ppl_fp, ppl_naive, ppl_smooth = _outlier_experiment(tiny_model_path, torch.device(device), dtype)
    print(f"[{w8a8_backend(torch.device(device))}] outlier model (x300, 4 ch/LN) {dtype} ppl {ppl_fp:.3f}, naive W8A8 "
          f"{ppl_naive:.3f} ({100 * (ppl_naive / ppl_fp - 1):+.2f}%), SmoothQuant W8A8 {ppl_smooth:.3f} "
          f"({100 * (ppl_smooth / ppl_fp - 1):+.2f}%)")
    assert ppl_naive >= 1.20 * ppl_fp
    assert abs(ppl_smooth / ppl_fp - 1) <= 0.02


def test_w8a8_linear_module_paths_agree():
    """W8A8Linear: ``fused`` (quantise inside) equals LayerNorm -> ``add_layer_norm_quant`` -> ``forward_quantized``
    (the fused-LayerNorm path) exactly, and both stay close to the fp32 linear (SQNR >= 30 dB)."""
    import math

    from fuseinfer.ops.layer_norm_quant import add_layer_norm_quant

    torch.manual_seed(0)
    ln, lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 48)
    with torch.no_grad():
        ln.weight.add_(0.1 * torch.randn(64))
        x, r = torch.randn(3, 5, 64), torch.randn(3, 5, 48)
        mod = sq.W8A8Linear.from_linear(lin)
        y = ln(x)
        a = mod.fused(y, residual=r)
        q, s, _ = add_layer_norm_quant(x, None, ln.weight, ln.bias, ln.eps)
        b = mod.forward_quantized(q, s, residual=r, out_dtype=torch.float32)
        assert torch.equal(a, b)
        ref = lin(y) + r
        sqnr = 10 * math.log10(ref.pow(2).sum() / (ref - a).pow(2).sum())
        assert sqnr >= 30, sqnr
        relu = mod.fused(y, activation="relu")
        assert (relu >= 0).all() and torch.allclose(relu, torch.relu(mod(y)))
