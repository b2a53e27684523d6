"""SmoothQuant W8A8 through ``patch(model, PatchConfig(quant=SmoothQuantW8A8(...)))`` on CPU: the patched model's
logits match the fp32 reference path (``smoothquant_reference``) on the same statistics; on the outlier model its
perplexity stays within 2% of fp32 while naive W8A8 loses clearly; calibration inside patch sees every linear;
unpatch restores (keep_original='cpu') or refuses; bad input is one FuseInferError with the model untouched."""
from __future__ import annotations

import copy

import pytest
import torch

import fuseinfer
from fuseinfer import FuseInferError, PatchConfig, SmoothQuantW8A8
from fuseinfer.quant import smoothquant as sq
from conftest import WIKITEXT
from helpers import assert_same_state, state

CAL = dict(samples=2, seq_len=128)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoTokenizer, OPTForCausalLM

    if not (WIKITEXT / sq.CALIBRATION_FILE).is_file():
        pytest.skip(f"WikiText-2 raw files not found in {WIKITEXT}; set FUSEINFER_SHARED")
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = OPTForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    stats = sq.calibrate(model, tok, data_dir=WIKITEXT, **CAL)
    return model, tok, stats


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_patch_matches_the_reference_path_and_calibrates_inside_patch(tiny):
    base, tok, stats = tiny
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(base)
    sq.smoothquant_reference(ref, stats, alpha=0.5)
    expected = logits(ref, ids)
    for cal in (stats, WIKITEXT):  # given statistics; text calibrated inside patch (fused modules already swapped)
        model = copy.deepcopy(base)
        report = fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(alpha=0.5, calibration=cal,
                                                                           tokenizer=tok, **CAL)))
        if cal is not stats:  # the hooks saw every linear's input: the same maxima as calibrating unpatched
            assert report.quant.calibration_seconds > 0
        got = logits(model, ids)
        err = (got - expected).abs().max().item()
        assert err <= 0.02 * expected.abs().max().item(), err
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.97
    text = str(report)
    assert "smoothquant_w8a8" in text and "alpha=0.5" in text and "calibration: 2 sample(s)" in text
    assert "qkv_proj" in text and "originals freed (unpatch refuses)" in text
    with pytest.raises(FuseInferError, match="keep_original='cpu'"):
        fuseinfer.unpatch(model)


def test_unpatch_restores_with_kept_originals(tiny):
    base, tok, stats = tiny
    model = copy.deepcopy(base)
    before = state(model)
    ids = torch.randint(3, 1000, (1, 32))
    fp = logits(model, ids)
    fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats, keep_original="cpu")))
    assert not torch.equal(logits(model, ids), fp)
    fuseinfer.unpatch(model)
    assert_same_state(model, before)
    assert torch.equal(logits(model, ids), fp)


@pytest.mark.parametrize("bad, match", [
    (dict(alpha=1.5), "alpha must be a number in"),
    (dict(alpha=float("nan")), "alpha must be a number in"),
    (dict(samples=0), "samples must be an integer"),
    (dict(calibration=3), "calibration= must be"),
    (dict(include_lm_head=True), "include_lm_head=False"),
    (dict(out_proj_input="per_token"), "out_proj_input must be one of"),
    (dict(fc2_input=None), "fc2_input must be one of"),
])
def test_bad_config(bad, match):
    with pytest.raises(FuseInferError, match=match):
        SmoothQuantW8A8(**bad)


def test_bad_inputs_leave_the_model_untouched(tiny, tmp_path, no_wikitext):
    base, tok, stats = tiny
    model = copy.deepcopy(base)
    before = state(model)
    with pytest.raises(FuseInferError, match=r"calibration="):  # no calibration data found
        fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(tokenizer=tok)))
    with pytest.raises(FuseInferError, match=r"calibration="):
        fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=tmp_path / "none.txt", tokenizer=tok)))
    other = sq.CalibrationStats({k: v[:8] for k, v in stats.act_max.items()}, 1, 8, "other")
    with pytest.raises(FuseInferError, match="calibrate this model"):
        fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=other)))
    assert_same_state(model, before)
    assert all(type(m).__module__.startswith("transformers") or type(m).__module__.startswith("torch")
               for m in model.modules())
    quantized = copy.deepcopy(base)  # already quantized (reference path), then patched: refused, untouched
    sq.quantize_linears_w8a8(quantized)
    q_before = state(quantized)
    with pytest.raises(FuseInferError, match="already (patched|quantized)"):  # the engine's check comes first
        fuseinfer.patch(quantized, PatchConfig(quant=SmoothQuantW8A8(calibration=stats)))
    assert_same_state(quantized, q_before)
    fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats)))
    with pytest.raises(FuseInferError, match="already patched and quantized"):
        fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats)))


def test_outlier_model_patched_w8a8_keeps_its_perplexity(tiny):
    from fuseinfer.harness.data import load_eval_text, tokenize
    from fuseinfer.harness.perplexity import gptq_windows, perplexity

    base, tok, _ = tiny
    if not (WIKITEXT / "wiki.test.raw").is_file():
        pytest.skip(f"wiki.test.raw not found in {WIKITEXT}")
    outlier = copy.deepcopy(base)
    sq.add_outlier_channels(outlier, channels=4, factor=300.0)
    windows = gptq_windows(tokenize(tok, load_eval_text(str(WIKITEXT)).text), 1024, 1)

    def ppl(model):
        with torch.no_grad():
            return perplexity(lambda i, l: model(input_ids=i, labels=l).loss, windows, "cpu").ppl

    ppl_fp = ppl(outlier)
    naive = copy.deepcopy(outlier)
    sq.smoothquant_reference(naive, None)  # W8A8 without smoothing
    ppl_naive = ppl(naive)
    fuseinfer.patch(outlier, PatchConfig(quant=SmoothQuantW8A8(alpha=0.5, calibration=WIKITEXT, tokenizer=tok,
                                                                **CAL)))
    ppl_w8a8 = ppl(outlier)
    print(f"outlier model fp32 ppl {ppl_fp:.3f}, naive W8A8 {ppl_naive:.3f}, patched SmoothQuant W8A8 {ppl_w8a8:.3f}")
    assert ppl_naive >= 1.20 * ppl_fp
    assert abs(ppl_w8a8 / ppl_fp - 1) <= 0.02


def test_eval_backend_is_registered():
    from fuseinfer.eval.backends import BACKENDS

    cls = BACKENDS["fuseinfer-w8a8"]
    assert "SmoothQuantW8A8" in cls.summary
    static = BACKENDS["fuseinfer-w8a8-static"]
    assert issubclass(static, cls) and "fc2_input='static', out_proj_input='static'" in static.summary


def test_eval_backend_calibration_flags_and_random_weights(monkeypatch, tmp_path):
    """--calibration-data / --calibration-samples reach the fuseinfer-w8a8 backend (in its options, else through
    their knobs); a random-weight model is calibrated on seeded token ids, and the calibration time is reported
    apart."""
    from types import SimpleNamespace

    from fuseinfer.eval.backends import BACKENDS
    from fuseinfer.eval.cli import build_parser, settings_from_args
    from fuseinfer.eval.runner import backend_options
    from tests.conftest import random_opt

    args = build_parser().parse_args(["--calibration-data", "cal.txt", "--calibration-samples", "3"])
    assert (args.calibration_data, args.calibration_samples) == ("cal.txt", 3)
    cls = BACKENDS["fuseinfer-w8a8"]
    cpu = (SimpleNamespace(random_weights=True), None, torch.float32, torch.device("cpu"), 0)
    config = cls(*cpu, backend_options(settings_from_args(args))).quant_config()
    assert config.calibration == "cal.txt" and config.samples == 3
    monkeypatch.delenv("FUSEINFER_CALIBRATION_DATA", raising=False)
    folder = build_parser().parse_args(["--data-dir", str(tmp_path)])  # its wiki.valid.raw, when no calibration flag
    assert cls(*cpu, backend_options(settings_from_args(folder))).quant_config().calibration == str(tmp_path)
    monkeypatch.setenv("FUSEINFER_CALIBRATION_DATA", str(tmp_path))
    monkeypatch.setenv("FUSEINFER_CALIBRATION_SAMPLES", "3")
    config = cls(*cpu).quant_config()
    assert config.calibration == str(tmp_path) and config.samples == 3
    monkeypatch.setenv("FUSEINFER_CALIBRATION_SAMPLES", "2")
    monkeypatch.delenv("FUSEINFER_CALIBRATION_DATA")
    backend = cls(*cpu)
    backend.model = random_opt()
    backend.stats = SimpleNamespace(weight_bytes_per_token=1)
    backend.prepare()
    details = backend.details()
    assert details["calibration_samples"] == 2 and details["calibration_seconds"] > 0
    assert details["calibration_source"].startswith("random token ids")
    assert details["quantized_weights"] == 2 * 4  # q/k/v fused, out_proj, fc1, fc2 per layer
    assert details["prefill_path"].startswith("lean loop")  # W8A8 prefill runs the lean loop / prefill graphs


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.float16, marks=pytest.mark.gpu)])
def test_static_inputs_perplexity_within_half_a_percent(tiny_model_path, device, dtype):
    """SmoothQuantW8A8 with out_proj_input="static", then with fc2_input="static" too, the input scales calibrated on
    the WikiText-2 validation split (8 windows of 512 tokens): test perplexity within 0.5% of the unquantized model
    (CPU fp32: the exact int8 emulation; CUDA fp16: the attention kernel writes out_proj's int8 input, fc1's GEMM
    fc2's), as dynamic W8A8 (printed beside them)."""
    from helpers import tiny_opt_and_tokenizer, wikitext_ppl, wikitext_windows

    base, tok = tiny_opt_and_tokenizer(tiny_model_path, dtype, device)
    windows = wikitext_windows(tok)
    ppl_fp = wikitext_ppl(base, windows, torch.device(device))
    ppls = {}
    for mode, fc2 in (("dynamic", "dynamic"), ("static", "dynamic"), ("static", "static")):
        model = copy.deepcopy(base)
        fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(out_proj_input=mode, fc2_input=fc2,
                                                                 calibration=WIKITEXT, tokenizer=tok, samples=8,
                                                                 seq_len=512)))
        layers = model.model.decoder.layers
        assert all((layer.self_attn.out_proj.input_scale is not None) == (mode == "static") for layer in layers)
        assert all((layer.fc2.input_scale is not None) == (fc2 == "static") for layer in layers)
        ppls[mode, fc2] = wikitext_ppl(model, windows, torch.device(device))
    print(f"opt-wt2-tiny {dtype} ppl {ppl_fp:.3f}, W8A8 " + ", ".join(
        f"out_proj {m} fc2 {f} {p:.3f} ({100 * (p / ppl_fp - 1):+.3f}%)" for (m, f), p in ppls.items()))
    assert len(set(ppls.values())) == 3
    assert all(abs(p / ppl_fp - 1) < 0.005 for p in ppls.values())
