"""Quantized checkpoints through transformers, on CPU with the shared tiny OPT: ``save_pretrained`` ->
``AutoModelForCausalLM.from_pretrained`` gives the same logits (W8A16 and SmoothQuant W8A8), ``save_pretrained`` and
``save_quantized`` write the same files, and everything that would take the folder for a plain OPT refuses (plain
transformers, the eval and export CLIs) instead of initialising the missing weights at random."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import WIKITEXT, random_opt

import fuseinfer
from fuseinfer import FuseInferError, Int8WeightOnly, PatchConfig, SmoothQuantW8A8


def _quantized(tiny_model_path, scheme: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    if scheme == "int8":
        quant = Int8WeightOnly()
    else:
        if not (WIKITEXT / "wiki.valid.raw").is_file():
            pytest.skip(f"wiki.valid.raw not found in {WIKITEXT}; set FUSEINFER_SHARED")
        quant = SmoothQuantW8A8(calibration=str(WIKITEXT / "wiki.valid.raw"), samples=2, seq_len=64)
    fuseinfer.patch(model, PatchConfig(quant=quant))
    return model


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_save_pretrained_from_pretrained_round_trip(tiny_model_path, tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    model = _quantized(tiny_model_path, scheme)
    model.save_pretrained(tmp_path / "a")
    fuseinfer.save_quantized(model, tmp_path / "b")
    for name in ("config.json", "model.safetensors"):  # one writer for both
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    record = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert record["quant_method"] == "fuseinfer"
    assert record["scheme"] == {"int8": "int8_weight_only", "w8a8": "smoothquant_w8a8"}[scheme]

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    state = fuseinfer.patch_state(loaded)
    assert state is not None and state.config.quant.scheme == record["scheme"]
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # and the loaded model saves the same tensors again
    loaded.save_pretrained(tmp_path / "c")
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()


def test_quantized_lm_head_round_trips_through_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = random_opt(seed=3)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(include_lm_head=True)))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_plain_transformers_refuses_the_folder(tmp_path):
    """Without fuseinfer imported, transformers only warns about quant_method 'fuseinfer': the guard tensor makes it
    refuse (size mismatch) instead of initialising the missing fp16 weights at random."""
    model = random_opt()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    model.save_pretrained(tmp_path)
    code = ("import sys; from transformers import AutoModelForCausalLM; "
            "AutoModelForCausalLM.from_pretrained(sys.argv[1]); assert 'fuseinfer' not in sys.modules")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "ignore_mismatched_sizes" in run.stderr


def test_dtype_and_pickles_refused_by_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = random_opt()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    model.save_pretrained(tmp_path)
    with pytest.raises(FuseInferError, match="checkpoint is float32, not float16.*--dtype fp32"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")  # never unpickled
    with pytest.raises(FuseInferError, match="safetensors only"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_auto_map_is_ignored(tmp_path):
    from transformers import AutoModelForCausalLM

    model = random_opt()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Model", "AutoConfig": "evil.Config"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "evil.py").write_text("raise SystemExit('code from the checkpoint ran')\n")
    ids = torch.randint(0, 512, (1, 5))
    with torch.no_grad():
        assert torch.equal(fuseinfer.load_quantized(tmp_path)(ids).logits, model(ids).logits)
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_save_pretrained_arguments_and_unpatch(tmp_path):
    model = random_opt()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(keep_original="cpu")))
    model.save_pretrained(tmp_path / "a", max_shard_size="5GB", safe_serialization=True)  # (push_to_hub's call)
    with pytest.raises(FuseInferError, match="does not take variant"):
        model.save_pretrained(tmp_path / "b", variant="fp16")
    assert not (tmp_path / "b").exists()
    fuseinfer.unpatch(model)
    assert "save_pretrained" not in vars(model)  # transformers' own again
    model.save_pretrained(tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())


@pytest.mark.parametrize("cli", ["eval", "export", "profile"])
def test_clis_refuse_what_needs_the_unquantized_model_in_one_line(tmp_path, capsys, cli):
    """The eval's other backends, the ONNX export and the profiler start from fp16 / fp32 weights the checkpoint
    does not hold: one error line naming the fix, nothing written."""
    model = random_opt()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    model.save_pretrained(tmp_path / "q")
    if cli == "eval":
        from fuseinfer.eval.cli import main

        rc = main(["--model", str(tmp_path / "q"), "--backends", "eager,fuseinfer", "--device", "cpu",
                   "--max-windows", "1"])
    elif cli == "export":
        from fuseinfer.export.cli import main

        rc = main(["onnx", "--model", str(tmp_path / "q"), "--out", str(tmp_path / "onnx"), "--device", "cpu"])
    else:
        from fuseinfer.profile.cli import main

        rc = main(["--model", str(tmp_path / "q"), "--backend", "fuseinfer", "--phase", "prefill", "--device", "cpu",
                   "--out", str(tmp_path / "onnx")])
    assert not (tmp_path / "onnx").exists()
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning:")]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert "fuseinfer quantized checkpoint (int8_weight_only)" in err[0] and "unquantized model" in err[0]


def test_eval_runs_a_quantized_folder_as_saved(tiny_model_path, tmp_path):
    """``python -m fuseinfer.eval --model <quantized folder> --backends fuseinfer`` loads it quantized (through
    from_pretrained) and measures it: its perplexity equals the saved model's, nothing is quantized again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fuseinfer.eval.cli import main

    model = _quantized(tiny_model_path, "int8")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "q")  # (kept: the model's files only)
    model.save_pretrained(tmp_path / "q")
    out = tmp_path / "r.json"
    rc = main(["--model", str(tmp_path / "q"), "--backends", "fuseinfer", "--device", "cpu", "--dtype", "fp32",
               "--data-dir", str(WIKITEXT), "--max-windows", "1", "--seq-len", "128", "--skip-latency",
               "--output", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())["backends"]["fuseinfer"]
    assert row["status"] == "ok" and row["ppl"] is not None, (row.get("ppl_note"), json.loads(out.read_text()).get("ppl_note"))
    ids = torch.tensor([[2, 100, 200, 300, 400]])
    with torch.no_grad():
        ref = model(ids).logits
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()(ids).logits
    torch.testing.assert_close(again, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_from_pretrained_onto_the_gpu(tiny_model_path, tmp_path, scheme):
    """fp16 on CUDA: from_pretrained(device_map={"": "cuda"}) gives the saved model's tensors and greedy logits, and
    the same model as load_quantized(device="cuda")."""
    from transformers import AutoModelForCausalLM

    model = _quantized(tiny_model_path, scheme)
    model.save_pretrained(tmp_path / "f32")  # (the fp32 checkpoint is refused in fp16: the scales' dtype)
    with pytest.raises(FuseInferError, match="--dtype fp32"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.float16, device_map={"": "cuda"})
    fp16 = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    quant = Int8WeightOnly() if scheme == "int8" else SmoothQuantW8A8(
        calibration=str(WIKITEXT / "wiki.valid.raw"), samples=2, seq_len=64)
    fuseinfer.patch(fp16, PatchConfig(quant=quant))
    fp16.save_pretrained(tmp_path / "f16")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "f16", device_map={"": "cuda"})
    direct = fuseinfer.load_quantized(tmp_path / "f16", device="cuda")
    a, b, c = fp16.state_dict(), loaded.state_dict(), direct.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(b[k].is_cuda and torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    ids = torch.randint(0, fp16.config.vocab_size, (2, 11), device="cuda")
    with torch.no_grad():
        assert torch.equal(fp16(ids).logits, loaded(ids).logits)
        assert torch.equal(direct(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("first", ["fuseinfer", "transformers"])
def test_registration_in_either_import_order(first):
    """import fuseinfer registers quant_method 'fuseinfer' without importing transformers itself (a one-shot
    import hook registers when transformers' quantizer registry is imported), or at once if it already is."""
    code = ("import sys\n"
            + ("import fuseinfer\nassert 'transformers.quantizers.auto' not in sys.modules\n" if first == "fuseinfer"
               else "import transformers.modeling_utils\nimport fuseinfer\n")
            + "from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING as C, AUTO_QUANTIZER_MAPPING "
              "as Q\nassert C['fuseinfer'].__name__ == 'FuseInferQuantizationConfig' and 'fuseinfer' in Q\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_a_copied_or_pickled_quantized_model_saves_itself(tmp_path):
    """save_pretrained of a deep copy (or of a model pickled and loaded) writes that model, not the original."""
    import copy
    import io

    model = random_opt()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    twin = copy.deepcopy(model)
    assert twin.save_pretrained._model() is twin
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.save_pretrained._model() is loaded
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1)
    twin.save_pretrained(tmp_path / "twin")
    model.save_pretrained(tmp_path / "orig")
    assert (tmp_path / "twin" / "model.safetensors").read_bytes() != (tmp_path / "orig" / "model.safetensors").read_bytes()
