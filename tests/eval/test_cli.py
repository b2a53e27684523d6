"""Tests of ``python -m fuseinfer.eval`` on CPU with the shared tiny OPT and WikiText-2 files.

Assets are found through $FUSEINFER_SHARED (default: <repo root>/../shared); tests that need them skip, saying
so, when they are absent.
"""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fuseinfer.eval import BACKENDS, EvalError, Settings, main, run
from fuseinfer.harness.backends import EagerBackend
from fuseinfer.harness.data import load_eval_text, rows_from_file
from fuseinfer.harness.models import load_config, load_model, resolve_model
from fuseinfer.models.opt.configs import OPT_CONFIGS
from fuseinfer.harness.perplexity import sliding_windows
from fuseinfer.harness.ui import ConsoleUI

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("FUSEINFER_SHARED", REPO.parent / "shared"))
TINY = SHARED / "models" / "opt-wt2-tiny"
DATA = SHARED / "data" / "wikitext-2-raw"

needs_tiny = pytest.mark.skipif(not (TINY / "config.json").is_file(),
                                reason=f"tiny model not found at {TINY} (set FUSEINFER_SHARED)")
needs_data = pytest.mark.skipif(not (DATA / "wiki.test.raw").is_file(),
                                reason=f"wiki.test.raw not found in {DATA} (set FUSEINFER_SHARED)")

# small settings: a CPU run of the tiny model in seconds
FAST = dict(device="cpu", dtype="fp32", prompt_len=16, gen_len=4, warmup=0, repeats=2, seq_len=256, max_windows=3)


def quiet_ui() -> ConsoleUI:
    return ConsoleUI(Console(file=io.StringIO()))


def readme_eval_text() -> str:
    """The evaluation string exactly as the data README builds it."""
    text = (DATA / "wiki.test.raw").read_text(encoding="utf-8")
    rows = [line if line.strip() else "" for line in text.splitlines(keepends=True)]
    return "\n\n".join(rows)


# ---- data ----

@needs_data
def test_rows_are_the_hf_dataset_rows():
    rows = rows_from_file(DATA / "wiki.test.raw")
    assert len(rows) == 4358
    assert rows[:3] == ["", " = Robert Boulter = \n", ""]
    assert len("\n\n".join(rows)) == 1_294_336


@needs_data
def test_eval_text_from_flag_and_env(monkeypatch):
    from_flag = load_eval_text(str(DATA))
    assert from_flag.text == readme_eval_text() and from_flag.rows == 4358
    monkeypatch.setenv("FUSEINFER_DATA_DIR", str(DATA))
    assert load_eval_text(None).text == from_flag.text


# ---- models ----

def test_short_names_and_hub_ids():
    assert resolve_model("opt-1.3b").path == "facebook/opt-1.3b"
    assert resolve_model("OPT-125M").path == "facebook/opt-125m"
    assert resolve_model("facebook/opt-66b").kind == "hub"
    source = resolve_model("random:opt-350m")
    assert source.random_weights and source.path == "facebook/opt-350m"
    assert resolve_model("random:someorg/some-model").path == "someorg/some-model"


@pytest.mark.parametrize("name", ["opt-7b", "gpt2-ish", "random:", "random:opt-7b", "./no/such/dir", "a/b/c"])
def test_bad_model_names(name):
    with pytest.raises(EvalError):
        resolve_model(name)


def test_failed_hub_load_offers_random_weights_only_where_built_in():
    from fuseinfer.harness.models import _load_failed

    offline = OSError("couldn't connect to huggingface.co")
    assert "or random:opt-125m for latency" in str(_load_failed(resolve_model("opt-125m"), offline))
    message = str(_load_failed(resolve_model("models/opt-wt2-tiny"), offline))  # no built-in config for it
    assert "random:" not in message and f"no local directory {os.path.abspath('models/opt-wt2-tiny')}" in message


@needs_tiny
def test_local_dir_and_random_local():
    assert resolve_model(str(TINY)).kind == "local"
    source = resolve_model(f"random:{TINY}")
    assert source.random_weights and source.path == str(TINY)


@pytest.mark.parametrize("name, billions", [("opt-125m", 0.1252), ("opt-350m", 0.3312), ("opt-1.3b", 1.3158),
                                            ("opt-2.7b", 2.6516), ("opt-6.7b", 6.6585), ("opt-13b", 12.853),
                                            ("opt-30b", 29.975), ("opt-66b", 65.720)])
def test_builtin_configs_have_the_published_sizes(name, billions):
    from transformers import AutoModelForCausalLM

    config = load_config(resolve_model(f"random:{name}"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=1e-3)
    assert config.do_layer_norm_before == (name != "opt-350m")
    assert config.word_embed_proj_dim == (512 if name == "opt-350m" else config.hidden_size)
    assert OPT_CONFIGS[f"facebook/{name}"]["max_position_embeddings"] == 2048


@needs_tiny
def test_random_weights_are_seeded_and_realistic():
    source = resolve_model(f"random:{TINY}")
    config = load_config(source)
    a, b = (load_model(source, config, torch.float32, torch.device("cpu"), seed=3) for _ in range(2))
    fc1_a, fc1_b = a.model.decoder.layers[0].fc1.weight, b.model.decoder.layers[0].fc1.weight
    assert torch.equal(fc1_a, fc1_b)
    assert fc1_a.std().item() == pytest.approx(0.02, rel=0.05)


# ---- perplexity ----

def independent_ppl(seq_len: int, windows: int) -> float:
    """GPTQ-protocol PPL with a plain transformers forward and cross entropy written out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(TINY)(readme_eval_text(), return_tensors="pt").input_ids  # (1, N)
    nlls = []
    with torch.no_grad():
        for i in range(windows):
            w = ids[:, i * seq_len:(i + 1) * seq_len]  # (1, L)
            logp = torch.log_softmax(model(input_ids=w).logits[:, :-1].double(), dim=-1)  # (1, L-1, V)
            nlls.append(-logp.gather(-1, w[:, 1:, None]).mean().item())
    return math.exp(sum(nlls) / len(nlls))


@needs_tiny
@needs_data
def test_eager_ppl_is_exact_and_fuseinfer_matches():
    settings = Settings(model=str(TINY), backends=("eager", "fuseinfer"), data_dir=str(DATA), skip_latency=True,
                        **FAST)
    rows = run(settings, quiet_ui())["backends"]
    expected = independent_ppl(FAST["seq_len"], FAST["max_windows"])
    assert rows["eager"]["ppl"] == pytest.approx(expected, rel=1e-4)
    assert rows["fuseinfer"]["ppl"] == pytest.approx(rows["eager"]["ppl"], rel=1e-3)


@needs_tiny
@needs_data
def test_sliding_window_scores_each_token_once():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    max_length, stride, count = 128, 48, 4
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(TINY)(readme_eval_text(), return_tensors="pt").input_ids  # (1, N)
    token_nll, guide_sum, guide_tokens, prev_end = [], 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, stride * count, stride):  # the loop of the transformers perplexity guide
            end = min(begin + max_length, ids.shape[1])
            trg_len = end - prev_end
            input_ids = ids[:, begin:end]
            target_ids = input_ids.clone()
            target_ids[:, :-trg_len] = -100
            logits = model(input_ids).logits  # (1, L, V)
            logp = torch.log_softmax(logits[0, :-1].double(), dim=-1)  # (L-1, V): predicts input_ids[0, 1:]
            nll = -logp.gather(-1, input_ids[0, 1:, None])[:, 0]  # (L-1,)
            token_nll += nll[-(min(trg_len, end - begin - 1)):].tolist()  # the new tokens, each scored once
            num_loss_tokens = (target_ids != -100).sum().item() - target_ids.size(0)  # the guide's count
            guide_sum += model(input_ids, labels=target_ids).loss.item() * num_loss_tokens
            guide_tokens += num_loss_tokens
            prev_end = end
    assert len(token_nll) == max_length - 1 + stride * (count - 1)
    settings = Settings(model=str(TINY), backends=("eager",), data_dir=str(DATA), skip_latency=True,
                        **{**FAST, "seq_len": max_length, "max_windows": count}, stride=stride)
    ppl = run(settings, quiet_ui())["backends"]["eager"]["ppl"]
    assert ppl == pytest.approx(math.exp(sum(token_nll) / len(token_nll)), rel=1e-4)
    # the guide counts one token fewer per later window, which weights the context-poor first window a bit more
    assert ppl == pytest.approx(math.exp(guide_sum / guide_tokens), rel=1e-2)
    assert [w.weight for w in sliding_windows(ids, max_length, stride, count)] == [max_length - 1] + [stride] * 3


def test_sliding_windows_leave_out_a_window_that_scores_nothing():
    """N = k * stride + 1 tokens with stride = max_length: the last window would hold one token and score none
    (a NaN loss, which made the PPL NaN)."""
    ids = torch.arange(3 * 16 + 1).view(1, -1)
    windows = sliding_windows(ids, 16, 16)
    assert [w.weight for w in windows] == [15, 15, 15]
    assert sliding_windows(ids[:, :1], 2, 1) == []  # one token: no window (the runner says so)


# ---- the command line ----

ROW_KEYS = {"ppl", "prefill_ms", "decode_ms_per_token", "peak_memory", "tokens_per_s", "speedup_prefill",
            "speedup_decode", "prefill_tflops", "decode_gbps", "first_call_s", "status"}


def cli_args(tmp_path, *extra):
    return ["--model", str(TINY), "--device", "cpu", "--dtype", "fp32", "--data-dir", str(DATA), "--seq-len", "256",
            "--max-windows", "2", "--prompt-len", "16", "--gen-len", "4", "--warmup", "0", "--repeats", "2",
            "--output", str(tmp_path / "r.json"), *extra]


@needs_tiny
@needs_data
def test_cli_end_to_end(tmp_path, capsys):
    rc = main(cli_args(tmp_path, "--backends", "eager,fuseinfer", "--markdown", str(tmp_path / "r.md"),
                       "--plot", str(tmp_path / "r.png")))
    assert rc == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results) >= {"settings", "environment", "model", "data", "backends", "copy_gbps"}
    assert set(results["environment"]) >= {"gpu", "driver", "cuda", "torch", "transformers", "fuseinfer",
                                           "fuseinfer_extension"}
    assert results["settings"]["seq_len"] == 256 and results["data"]["windows"] == 2
    for name in ("eager", "fuseinfer"):
        row = results["backends"][name]
        assert ROW_KEYS <= set(row) and row["status"] == "ok"
        assert row["ppl"] > 1 and row["prefill_ms"]["median"] > 0 and row["decode_ms_per_token"]["n"] == 8
        assert row["peak_memory"] is None  # CPU: no allocator statistics
    fused = results["backends"]["fuseinfer"]
    assert fused["greedy_match_eager"] == 1.0
    assert set(fused["patch_backends"]) == {"attention", "layer_norm", "linear", "qkv"}
    assert "| eager |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "fuseinfer" in capsys.readouterr().out


@needs_tiny
def test_cli_random_model_subprocess(tmp_path):
    args = ["--model", f"random:{TINY}", "--backends", "eager", "--device", "cpu", "--prompt-len", "8", "--gen-len",
            "2", "--warmup", "0", "--repeats", "1", "--output", str(tmp_path / "r.json")]
    proc = subprocess.run([sys.executable, "-m", "fuseinfer.eval", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "r.json").read_text())["backends"]["eager"]
    assert row["ppl"] is None and "random" in row["ppl_note"]
    assert row["decode_ms_per_token"]["median"] > 0


def assert_one_line_error(capsys, rc, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error:") and "Traceback" not in err[0]
    for word in words:
        assert word in err[0]


def test_unknown_backend(capsys):
    assert_one_line_error(capsys, main(["--model", "opt-125m", "--backends", "eager,vllm"]), "vllm",
                          "eager, compile, fuseinfer")


@needs_tiny
def test_missing_data_dir(tmp_path, capsys):
    rc = main(["--model", str(TINY), "--device", "cpu", "--data-dir", str(tmp_path)])
    assert_one_line_error(capsys, rc, "--data-dir", "wiki.test.raw", "FUSEINFER_DATA_DIR")


@needs_tiny
def test_data_file_that_is_not_utf8(tmp_path, capsys):
    (tmp_path / "wiki.test.raw").write_bytes("caf\u00e9\n".encode("latin-1"))
    rc = main(["--model", str(TINY), "--device", "cpu", "--data-dir", str(tmp_path)])
    assert_one_line_error(capsys, rc, "cannot read", "as UTF-8 text")


@needs_tiny
@needs_data
def test_model_folder_without_tokenizer_skips_perplexity(tmp_path):
    """(transformers 5.x loads an empty tokenizer from a folder without tokenizer files instead of raising)"""
    import shutil

    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (TINY / name).exists():
            shutil.copy(TINY / name, tmp_path / name)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--model", str(tmp_path), "--backends", "eager", "--device", "cpu", "--data-dir", str(DATA),
            "--prompt-len", "8", "--gen-len", "2", "--warmup", "0", "--repeats", "1", "--output", str(out / "r.json")]
    assert main(args) == 0
    row = json.loads((out / "r.json").read_text())["backends"]["eager"]
    assert row["ppl"] is None and "no tokenizer" in row["ppl_note"]


def test_model_path_to_a_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    rc = main(["--model", str(tmp_path / "config.json"), "--device", "cpu"])
    assert_one_line_error(capsys, rc, "is a file", "pass the folder")


@pytest.mark.gpu
def test_cuda_index_beyond_the_visible_gpus(capsys):
    rc = main(["--model", "opt-125m", "--device", f"cuda:{torch.cuda.device_count() + 3}"])
    assert_one_line_error(capsys, rc, "only", "visible", "cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_gpu(capsys):
    assert_one_line_error(capsys, main(["--model", "opt-125m", "--device", "cuda"]), "no CUDA GPU")


def test_unknown_model(capsys):
    assert_one_line_error(capsys, main(["--model", "opt-7b", "--device", "cpu"]), "opt-7b", "random:")


def test_error_subprocess_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "fuseinfer.eval", "--model", "opt-125m", "--backends", "onnx"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: unknown backend 'onnx': choose from "
                                                   + ", ".join(BACKENDS)]


def _no_run(*args, **kwargs):
    raise AssertionError("the run started before the bad argument was reported")


@pytest.mark.parametrize("flag, name", [("--output", "r.json"), ("--markdown", "r.md"), ("--plot", "r.png")])
def test_unwritable_output_is_refused_before_the_run(tmp_path, capsys, monkeypatch, flag, name):
    monkeypatch.setattr("fuseinfer.eval.cli.run", _no_run)
    blocker = tmp_path / "results"
    blocker.write_text("a file where the output folder should be")
    rc = main(["--model", "random:opt-125m", "--device", "cpu", flag, str(blocker / name)])
    assert_one_line_error(capsys, rc, flag, str(blocker / name), "is a file, not a folder", "choose another path")


def test_output_that_is_a_folder_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fuseinfer.eval.cli.run", _no_run)
    rc = main(["--model", "random:opt-125m", "--device", "cpu", "--markdown", str(tmp_path)])
    assert_one_line_error(capsys, rc, "--markdown", str(tmp_path), "folder")


def test_unsupported_plot_format_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr("fuseinfer.eval.cli.run", _no_run)
    rc = main(["--model", "random:opt-125m", "--device", "cpu", "--plot", str(tmp_path / "r.xyz")])
    assert_one_line_error(capsys, rc, "--plot", ".xyz", ".png")


def test_output_write_failure_after_the_run_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"

    def run_that_takes_the_path(settings, ui):
        out.mkdir()  # the path became unwritable while the benchmark ran
        return {}

    monkeypatch.setattr("fuseinfer.eval.cli.run", run_that_takes_the_path)
    monkeypatch.setattr("fuseinfer.eval.cli.print_table", lambda results, console: None)
    rc = main(["--model", "random:opt-125m", "--device", "cpu", "--output", str(out)])
    assert_one_line_error(capsys, rc, "--output", str(out), "choose another path")


@pytest.mark.parametrize("extra, window", [(["--seq-len", "64", "--stride", "128"], 64), (["--stride", "4096"], 2048)])
def test_stride_longer_than_the_window_is_refused_before_loading(capsys, monkeypatch, extra, window):
    monkeypatch.setattr("fuseinfer.eval.runner.run_backend", _no_run)
    rc = main(["--model", "random:opt-125m", "--device", "cpu", *extra])
    assert_one_line_error(capsys, rc, f"--stride {extra[-1]}", f"window length {window}")


# ---- backends that cannot run ----

class _Unavailable(EagerBackend):
    name = "unavailable"

    @classmethod
    def unavailable_reason(cls, device):
        return "its runtime is not installed"


class _Broken(EagerBackend):
    name = "broken"

    def prepare(self):
        raise RuntimeError("export failed\nsecond line")


@needs_tiny
def test_backend_that_cannot_run_is_reported_and_others_run(monkeypatch):
    monkeypatch.setitem(BACKENDS, "unavailable", _Unavailable)
    monkeypatch.setitem(BACKENDS, "broken", _Broken)
    settings = Settings(model=str(TINY), backends=("unavailable", "broken", "eager"), skip_ppl=True, **FAST)
    rows = run(settings, quiet_ui())["backends"]
    assert rows["unavailable"]["status"] == "unavailable" and "not installed" in rows["unavailable"]["error"]
    assert rows["broken"]["status"] == "error" and rows["broken"]["error"] == "RuntimeError: export failed"
    assert rows["eager"]["status"] == "ok" and rows["eager"]["decode_ms_per_token"]["median"] > 0


@pytest.mark.slow
@needs_tiny
@needs_data
def test_compile_backend_matches_eager():
    settings = Settings(model=str(TINY), backends=("eager", "compile"), data_dir=str(DATA), **FAST)
    rows = run(settings, quiet_ui())["backends"]
    assert rows["compile"]["status"] == "ok", rows["compile"]["error"]
    assert rows["compile"]["ppl"] == pytest.approx(rows["eager"]["ppl"], rel=1e-4)
    assert rows["compile"]["greedy_match_eager"] == 1.0
    assert rows["compile"]["first_call_s"]["prefill"] > 0


@pytest.mark.parametrize("args,words", [
    (["--prompt-len", "0"], ["--prompt-len", "at least 1"]),
    (["--batch-size", "0"], ["--batch-size", "at least 1"]),
    (["--prompt-len", "2000", "--gen-len", "100"], ["--prompt-len + --gen-len", "positions"]),
    (["--skip-latency", "--seq-len", "4096"], ["--seq-len 4096", "positions"]),
    (["--skip-latency", "--seq-len", "512", "--stride", "600"], ["--stride 600", "lower --stride"]),
    (["--device", "tpu"], ["tpu"]),
    (["--skip-latency", "--skip-ppl"], ["nothing to measure", "drop one"]),
])
@needs_tiny
def test_size_and_device_errors(args, words, capsys):
    """Sizes checked against the model's positions (2048 for opt-wt2-tiny) and bad devices: one line each."""
    rc = main(["--model", str(TINY), "--device", "cpu", *args] if "--device" not in args else
              ["--model", str(TINY), *args])
    assert_one_line_error(capsys, rc, *words)


def test_greedy_match_counts_equal_tokens():
    from fuseinfer.eval.runner import _greedy_match

    a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert _greedy_match(a, a.clone()) == 1.0
    assert _greedy_match(a, torch.tensor([[1, 2, 0, 0], [5, 6, 7, 8]])) == 0.75
    assert _greedy_match(None, a) is None


def test_derived_metrics_by_hand():
    """derive()'s formulas on round numbers: 1 layer, hidden 4, fp16, 100 matmul params, 10 LM-head params,
    1000 weight bytes per token; batch 2, prompt 3, 5 decode steps; prefill 2 ms, decode 4 ms per step."""
    from fuseinfer.harness.metrics import derive
    from fuseinfer.harness.models import ModelStats

    stats = ModelStats(params=0, matmul_params=100, lm_head_params=10, weight_bytes_per_token=1000, layers=1,
                       hidden=4, element_size=2)
    row = {"prefill_ms": {"median": 2.0}, "decode_ms_per_token": {"median": 4.0}}
    eager = {"prefill_ms": {"median": 6.0}, "decode_ms_per_token": {"median": 10.0}}
    out = derive(row, stats, batch=2, prompt_len=3, gen_len=5, copy_gbps=0.001, eager=eager)
    flops = 2 * 100 * 2 * 3 + 2 * 10 * 2 + 2 * 2 * 1 * 2 * 9 * 4 / 2  # linears + last-token LM head + attention
    step_bytes = 1000 + 2 * 1 * 2 * (3 + 3) * 4 * 2  # weights + K and V at the mean context 3 + (5 + 1) / 2
    assert out["prefill_tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert out["tokens_per_s"] == pytest.approx(2 * 1000 / 4)
    assert out["decode_gbps"] == pytest.approx(step_bytes / 4e-3 / 1e9)
    assert out["decode_bw_fraction"] == pytest.approx(step_bytes / 4e-3 / 1e9 / 0.001)
    assert out["speedup_prefill"] == pytest.approx(3.0) and out["speedup_decode"] == pytest.approx(2.5)


@pytest.mark.parametrize("skip_latency", [False, True])
def test_title_names_latency_settings_only_when_latency_ran(skip_latency):
    from fuseinfer.eval.report import _title

    results = {"environment": {"gpu": None, "cpu_threads": 2}, "model": {"spec": "opt-125m"},
               "settings": {"dtype": "fp32", "batch_size": 1, "prompt_len": 128, "gen_len": 32,
                            "skip_latency": skip_latency}}
    assert ("prompt 128, decode 32 tokens" in _title(results)) is not skip_latency


def test_eval_without_arguments_runs_offline_on_cpu(tmp_path, monkeypatch):
    """`python -m fuseinfer.eval` with no flags: the shared tiny model with the local WikiText-2 (perplexity that
    means something), eager and fuseinfer (no torch.compile on CPU), and the warning that no kernels run here."""
    if not (TINY / "config.json").exists():
        pytest.skip("shared tiny model not found (FUSEINFER_SHARED)")
    monkeypatch.setenv("FUSEINFER_SHARED", str(SHARED))
    monkeypatch.delenv("FUSEINFER_DATA_DIR", raising=False)
    out = tmp_path / "r.json"
    assert main(["--output", str(out), "--repeats", "1", "--warmup", "0", "--gen-len", "4", "--prompt-len", "16",
                 "--max-windows", "2"]) == 0
    results = json.loads(out.read_text())
    assert results["settings"]["model"] == str(TINY)
    assert list(results["backends"]) == ["eager", "fuseinfer"]
    assert results["data"]["windows"] == 2 and results["backends"]["fuseinfer"]["ppl"] > 1
    assert any("correctness, not of speed" in w for w in results["warnings"])


@pytest.mark.parametrize("flag, name", [("--output", "r.json"), ("--markdown", "r.md"), ("--plot", "r.png")])
def test_existing_output_needs_overwrite(tmp_path, capsys, monkeypatch, flag, name):
    monkeypatch.setattr("fuseinfer.eval.cli.run", _no_run)
    (tmp_path / name).write_text("earlier results")
    rc = main(["--model", "random:opt-125m", "--device", "cpu", flag, str(tmp_path / name)])
    assert_one_line_error(capsys, rc, flag, "exists; pass --overwrite")
    assert (tmp_path / name).read_text() == "earlier results"


def test_overwrite_replaces_the_output_atomically(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("earlier results")
    monkeypatch.setattr("fuseinfer.eval.cli.run", lambda settings, ui: {"backends": {}, "new": 1})
    monkeypatch.setattr("fuseinfer.eval.cli.print_table", lambda results, console: None)
    assert main(["--model", "random:opt-125m", "--device", "cpu", "--output", str(out), "--overwrite"]) == 0
    assert json.loads(out.read_text())["new"] == 1 and os.listdir(tmp_path) == ["r.json"]


def test_output_appearing_during_the_run_is_not_overwritten(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"

    def run_while_someone_writes(settings, ui):
        out.write_text("another run's results")
        return {"backends": {}}

    monkeypatch.setattr("fuseinfer.eval.cli.run", run_while_someone_writes)
    monkeypatch.setattr("fuseinfer.eval.cli.print_table", lambda results, console: None)
    rc = main(["--model", "random:opt-125m", "--device", "cpu", "--output", str(out)])
    assert_one_line_error(capsys, rc, "--output", "pass --overwrite")
    assert out.read_text() == "another run's results"
