"""fuseinfer.export: ONNX export (plain and fused), the ORT runtime and eval backends, bad input, TensorRT (skips).

CPU tests use the shared tiny OPT (tiny_model_path) and random OPTs of every layout; each export is made once per
module. GPU tests (marked gpu) check fp16 on CUDA with onnxruntime-gpu and IO binding.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, VARIANTS, WIKITEXT, random_opt
from fuseinfer.export import ExportError, OrtDecoder, to_onnx
from fuseinfer.export import manifest as mf

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e .[export])")
import onnx  # noqa: E402

ATOL = 1e-4  # fp32: ORT and PyTorch differ by summation order only
CONTRIB = "com.microsoft"


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_exports(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {fl: (to_onnx(tiny, root / fl, flavour=fl, source="opt-wt2-tiny"), root / fl) for fl in ("fused", "plain")}


def _padded_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding, as in batched generation
    return ids, mask


def _check_logits(model, directory, flavour, prompt_len=8):
    """Prefill (full logits) and decode steps with past, against one PyTorch forward over the whole batch."""
    ids, mask = _padded_batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits  # (2, 12, V)
    dec = OrtDecoder(directory, "cpu", model=model, flavour=flavour)
    valid = mask.bool()
    full = dec.logits(ids, mask)
    assert (full - ref)[valid].abs().max() < ATOL
    dec.start(2, 12)
    got = [dec.prefill(ids[:, :prompt_len], mask[:, :prompt_len]).clone()]
    for t in range(prompt_len, 12):
        got.append(dec.step(ids[:, t:t + 1]).clone())
    got = torch.cat(got, dim=1)  # logits of positions prompt_len - 1 ... 11
    assert (got - ref[:, prompt_len - 1:]).abs().max() < ATOL


@pytest.mark.parametrize("flavour", ["fused", "plain"])
def test_tiny_logits_match_pytorch(tiny, tiny_exports, flavour):
    _check_logits(tiny, tiny_exports[flavour][1], flavour)


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln_project_in_out", "no_bias", "ln_without_affine"])
@pytest.mark.parametrize("flavour", ["fused", "plain"])
def test_random_layouts_match_pytorch(tmp_path, variant, flavour):
    model = random_opt(**VARIANTS[variant])
    to_onnx(model, tmp_path / "x", flavour=flavour)
    _check_logits(model, tmp_path / "x", flavour, prompt_len=5)


@pytest.mark.parametrize("flavour", ["fused", "plain"])
def test_greedy_tokens_equal_32(tiny, tiny_exports, flavour):
    ids, _ = _padded_batch(tiny.config.vocab_size, seed=1)
    ids = ids[:1, :10]
    with torch.no_grad():
        ref = tiny.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=1)[:, 10:]
    dec = OrtDecoder(tiny_exports[flavour][1], "cpu")
    dec.start(1, 42)
    tok = dec.prefill(ids)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
    out = [tok]
    for _ in range(31):
        tok = dec.step(tok)[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    assert torch.equal(torch.cat(out, dim=1), ref)


def test_fused_graph_holds_the_contrib_ops_it_claims(tiny, tiny_exports):
    layers = tiny.config.num_hidden_layers
    for flavour, (manifest, directory) in tiny_exports.items():
        graph = onnx.load(str(directory / mf.MODEL_FILE), load_external_data=False).graph
        found = {}
        for node in graph.node:
            if node.domain == CONTRIB:
                found[node.op_type] = found.get(node.op_type, 0) + 1
        assert found == manifest["contrib_ops"]
        if flavour == "plain":
            assert found == {} and all(n.domain in ("", "ai.onnx") for n in graph.node)
        else:
            assert found["MultiHeadAttention"] == layers
            assert found["SkipLayerNormalization"] == 2 * layers + 1  # every residual add + LN, and the embeddings
            assert found["FusedMatMul"] == 4 * layers + 1  # qkv, out, fc1, fc2 per layer, lm_head
            attn = [n for n in graph.node if n.op_type == "MultiHeadAttention"][0]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attn.attribute}
            assert attrs["unidirectional"] == 1 and attrs["num_heads"] == tiny.config.num_attention_heads
            assert not any(n.op_type in ("Softmax", "LayerNormalization") for n in graph.node)


# The node types of the exported graphs (Constant nodes aside: exporter bookkeeping), pinned when the graph was
# written as the one decoder layer over export strategies: the same graph as the hand-written forward before it.
NODE_TYPES = {
    ("tiny", "fused"): {
        "Add": 5, "Cast": 4, "Concat": 1, "ConstantOfShape": 1, "CumSum": 1, "Equal": 2, "Expand": 1, "Gather": 5,
        "Mul": 3, "Neg": 2, "Relu": 4, "Reshape": 1, "Shape": 4, "Slice": 2, "Split": 4, "Sub": 1, "Unsqueeze": 6,
        "Where": 1, "com.microsoft.FusedMatMul": 17, "com.microsoft.MultiHeadAttention": 4,
        "com.microsoft.SkipLayerNormalization": 9},
    ("tiny", "plain"): {
        "Add": 35, "And": 1, "Cast": 10, "Concat": 24, "CumSum": 1, "Gather": 16, "Greater": 1,
        "LayerNormalization": 9, "LessOrEqual": 1, "MatMul": 33, "Mul": 5, "Neg": 2, "Range": 2, "Relu": 4,
        "Reshape": 16, "Shape": 14, "Slice": 2, "Softmax": 4, "Sub": 2, "Transpose": 20, "Unsqueeze": 43,
        "Where": 4},
    ("post_ln_project_in_out", "fused"): {
        "Add": 4, "Cast": 2, "Concat": 1, "ConstantOfShape": 1, "CumSum": 1, "Equal": 2, "Expand": 1, "Gather": 5,
        "Identity": 4, "Mul": 3, "Neg": 2, "Relu": 2, "Reshape": 1, "Shape": 4, "Slice": 2, "Split": 2, "Sub": 1,
        "Unsqueeze": 6, "Where": 1, "com.microsoft.FusedMatMul": 11, "com.microsoft.MultiHeadAttention": 2,
        "com.microsoft.SkipLayerNormalization": 4},
    ("post_ln_project_in_out", "plain"): {
        "Add": 19, "And": 1, "Cast": 6, "Concat": 12, "CumSum": 1, "Gather": 10, "Greater": 1, "Identity": 10,
        "LayerNormalization": 4, "LessOrEqual": 1, "MatMul": 19, "Mul": 3, "Neg": 2, "Range": 2, "Relu": 2,
        "Reshape": 8, "Shape": 8, "Slice": 2, "Softmax": 2, "Sub": 2, "Transpose": 10, "Unsqueeze": 25, "Where": 2},
}


def _node_types(manifest):
    return {k: v for k, v in manifest["op_counts"].items() if k != "Constant"}


@pytest.mark.parametrize("flavour", ["fused", "plain"])
def test_node_types_are_pinned(tiny_exports, tmp_path, flavour):
    assert _node_types(tiny_exports[flavour][0]) == NODE_TYPES["tiny", flavour]
    variant = "post_ln_project_in_out"
    manifest = to_onnx(random_opt(**VARIANTS[variant]), tmp_path / "x", flavour=flavour)
    assert _node_types(manifest) == NODE_TYPES[variant, flavour]


def test_unused_optional_outputs_are_dropped(tiny_exports):
    """SkipLayerNormalization's training outputs (mean, inv_std_var) are not requested: the CUDA kernel does not
    write them; the last one's residual sum is dropped too."""
    graph = onnx.load(str(tiny_exports["fused"][1] / mf.MODEL_FILE), load_external_data=False).graph
    sln = [n for n in graph.node if n.op_type == "SkipLayerNormalization"]
    assert all(list(n.output[1:3]) == ["", ""] for n in sln[:-1]) and all(n.output[3] for n in sln[:-1])
    assert list(sln[-1].output) == [sln[-1].output[0]] and sln[-1].output[0]


def test_cuda_run_must_not_fall_back_to_cpu():
    """A session that came up without the CUDA provider (its libraries did not load) is refused."""
    from fuseinfer.export.ort_runtime import check_providers

    class Session:
        def __init__(self, providers):
            self.providers = providers

        def get_providers(self):
            return self.providers

    with pytest.raises(ExportError, match="without the CUDA execution provider.*CPUExecutionProvider"):
        check_providers(Session(["CPUExecutionProvider"]), torch.device("cuda"), "1.31.1")
    check_providers(Session(["CUDAExecutionProvider", "CPUExecutionProvider"]), torch.device("cuda"), "1.31.1")
    check_providers(Session(["CPUExecutionProvider"]), torch.device("cpu"), "1.31.1")


def test_manifest_and_files(tiny, tiny_exports):
    manifest, directory = tiny_exports["fused"]
    assert sorted(os.listdir(directory)) == sorted([mf.MANIFEST, mf.MODEL_FILE, mf.DATA_FILE])
    on_disk = json.loads((directory / mf.MANIFEST).read_text())
    assert on_disk == manifest
    assert manifest["model"]["config_hash"] == mf.config_hash(tiny.config)
    names = [i["name"] for i in manifest["inputs"]]
    assert names[:3] == ["input_ids", "attention_mask", "num_logits_to_keep"]
    assert len(names) == 3 + 2 * tiny.config.num_hidden_layers
    assert (directory / mf.DATA_FILE).stat().st_size > 0.9 * sum(p.numel() * 4 for p in tiny.parameters())


def test_fresh_process_loads_and_matches(tiny_exports):
    directory = tiny_exports["fused"][1]
    dec = OrtDecoder(directory, "cpu")
    ids = torch.arange(3, 19).view(2, 8)
    here = dec.logits(ids)[:, -1].sum(-1)
    code = ("import torch; from fuseinfer.export import OrtDecoder;"
            f"d = OrtDecoder({str(directory)!r}, 'cpu');"
            "print(d.logits(torch.arange(3, 19).view(2, 8))[:, -1].sum(-1).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert torch.allclose(torch.tensor(json.loads(out.stdout.strip().splitlines()[-1])), here, atol=1e-4)


@pytest.mark.skipif(not (WIKITEXT / "wiki.test.raw").is_file(), reason=f"wiki.test.raw not found in {WIKITEXT}")
def test_eval_rows_ppl_and_greedy_match_eager(tiny_model_path, tmp_path, monkeypatch):
    """The eval CLI's runner with ort and ort-plain: PPL within 0.1% of eager, greedy tokens equal to eager's;
    the second run reuses the exports kept in the folder the settings name (``onnx_dir``, the CLI's --onnx-dir:
    handed to the backends, not through $FUSEINFER_ONNX_DIR, which names another folder here)."""
    from fuseinfer.eval import Settings, run
    from fuseinfer.harness.ui import ConsoleUI

    monkeypatch.setenv("FUSEINFER_ONNX_DIR", str(tmp_path / "not-this-one"))
    settings = Settings(model=str(tiny_model_path), backends=("eager", "ort", "ort-plain"), device="cpu",
                        dtype="fp32", prompt_len=16, gen_len=8, warmup=0, repeats=1, seq_len=256, max_windows=3,
                        data_dir=str(WIKITEXT), debug=True, onnx_dir=str(tmp_path / "exports"))
    ui = ConsoleUI(quiet=True) if "quiet" in ConsoleUI.__init__.__code__.co_varnames else ConsoleUI()
    rows = run(settings, ui)["backends"]
    for name in ("ort", "ort-plain"):
        assert rows[name]["status"] == "ok", rows[name]["error"]
        assert abs(rows[name]["ppl"] / rows["eager"]["ppl"] - 1) < 1e-3
        assert rows[name]["greedy_match_eager"] == 1.0
        assert rows[name]["export_reused"] is False
    assert len(os.listdir(tmp_path / "exports")) == 2 and not (tmp_path / "not-this-one").exists()
    again = run(Settings(**{**settings.__dict__, "backends": ("ort",), "skip_ppl": True}), ui)["backends"]["ort"]
    assert again["export_reused"] is True and again["status"] == "ok"


# --- bad input: one clear message each, nothing half-written

def test_non_opt_model_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ExportError, match="exports causal LMs.*opt.*'gpt2'"):
        to_onnx(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_model_without_lm_head_is_refused(tmp_path):
    with pytest.raises(ExportError, match="causal LMs.*AutoModelForCausalLM"):
        to_onnx(random_opt().model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_existing_out_dir_needs_overwrite(tmp_path):
    model = random_opt()
    to_onnx(model, tmp_path / "x")
    with pytest.raises(ExportError, match="earlier results; pass --overwrite"):
        to_onnx(model, tmp_path / "x", flavour="plain")
    assert mf.read(tmp_path / "x")["flavour"] == "fused"
    to_onnx(model, tmp_path / "x", flavour="plain", overwrite=True)
    assert mf.read(tmp_path / "x")["flavour"] == "plain"
    assert sorted(os.listdir(tmp_path)) == ["x"]  # no temporary or old directory left


def test_overwrite_never_replaces_a_folder_that_is_not_an_export(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ExportError, match="did not write.*choose another --out"):
            to_onnx(random_opt(), tmp_path / "x", overwrite=overwrite)
    assert os.listdir(tmp_path / "x") == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["x"]
    (tmp_path / "empty").mkdir()
    to_onnx(random_opt(), tmp_path / "empty")  # an empty folder holds nothing to lose
    assert mf.MANIFEST in os.listdir(tmp_path / "empty")


def _cli(args, cwd, timeout=180):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "fuseinfer.export", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def test_cli_overwrite_of_the_current_project_folder_is_refused(tiny_model_path, tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('my work')\n")
    (project / "README.md").write_text("mine\n")
    out = _cli(["onnx", "--model", str(tiny_model_path), "--out", ".", "--overwrite", "--device", "cpu"], project)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("error: ") and "choose another --out" in out.stderr
    assert sorted(os.listdir(project)) == ["README.md", "src"]
    assert (project / "src" / "main.py").read_text() == "print('my work')\n"
    assert sorted(os.listdir(tmp_path)) == ["project"]


def test_cli_unwritable_out_is_refused_before_loading(tiny_model_path, tmp_path, monkeypatch, capsys):
    from fuseinfer.export import cli

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(cli, "load_model", no_load)
    parent = "/sys" if os.geteuid() == 0 else str(tmp_path / "ro")  # root writes through permission bits
    if parent != "/sys":
        os.mkdir(parent, 0o555)
    rc = cli.main(["onnx", "--model", str(tiny_model_path), "--out", f"{parent}/fuseinfer-export", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and "not writable" in err
    assert not os.path.exists(f"{parent}/fuseinfer-export")


def test_export_from_a_folder_holding_model_onnx_data(tiny_model_path, tmp_path, monkeypatch):
    """onnx resolves the external data name against the current directory when asked to write it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / mf.DATA_FILE).write_text("someone else's file")
    model = random_opt()
    to_onnx(model, tmp_path / "x")
    assert (tmp_path / mf.DATA_FILE).read_text() == "someone else's file"
    OrtDecoder(tmp_path / "x", "cpu", model=model).logits(torch.arange(3, 9).view(1, 6))
    out = _cli(["onnx", "--model", str(tiny_model_path), "--out", "y", "--device", "cpu"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert mf.read(tmp_path / "y")["dtype"] == "fp32"


_KILLED = """
import sys, time
from conftest import random_opt
from fuseinfer.export import onnx_export, to_onnx
real = onnx_export._consolidate
def slow(src, dst):
    out = real(src, dst)
    print("consolidated", flush=True)
    time.sleep(60)
    return out
onnx_export._consolidate = slow
to_onnx(random_opt(), sys.argv[1])
"""


def test_export_killed_by_sigterm_leaves_nothing(tmp_path):
    import signal

    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path / "x")], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    assert proc.stdout.readline().strip() == "consolidated"
    assert os.listdir(tmp_path)  # the temporary export exists while writing
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert os.listdir(tmp_path) == []


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    from fuseinfer.export import onnx_export

    def boom(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(onnx_export, "_consolidate", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        to_onnx(random_opt(), tmp_path / "x")
    assert os.listdir(tmp_path) == []


def test_cli_bad_input_one_line(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    out = _cli(["onnx", "--model", "random:opt-125m", "--out", str(tmp_path / "x"), "--device", "cpu"], REPO)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert "did not write" in out.stderr and "choose another --out" in out.stderr


def test_missing_onnxruntime_names_the_package(monkeypatch):
    from fuseinfer.export import ort_runtime

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxruntime" else real(n, *a))
    with pytest.raises(ExportError, match="pip install onnxruntime"):
        ort_runtime.import_onnxruntime(torch.device("cpu"))
    from fuseinfer.eval import BACKENDS

    assert "onnxruntime-gpu" in BACKENDS["ort"].unavailable_reason(torch.device("cuda"))


def test_cpu_only_onnxruntime_asked_for_cuda(monkeypatch):
    import onnxruntime

    from fuseinfer.export import ort_runtime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(ExportError, match="no CUDA execution provider.*pip install onnxruntime-gpu"):
        ort_runtime.import_onnxruntime(torch.device("cuda"))


def test_stale_export_is_refused(tmp_path):
    model = random_opt()
    to_onnx(model, tmp_path / "x")
    with pytest.raises(ExportError, match="another model configuration.*config hash"):
        OrtDecoder(tmp_path / "x", "cpu", model=random_opt(num_hidden_layers=3))
    with pytest.raises(ExportError, match="other weights.*weights hash"):
        OrtDecoder(tmp_path / "x", "cpu", model=random_opt(seed=1))
    with pytest.raises(ExportError, match="'fused' flavour, 'plain' was asked"):
        OrtDecoder(tmp_path / "x", "cpu", model=model, flavour="plain")
    with pytest.raises(ExportError, match="not a fuseinfer ONNX export"):
        OrtDecoder(tmp_path, "cpu")


# --- TensorRT: written against the documented API, never run on our machines

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
NO_TRT = "TensorRT is not installed (the TensorRT path is written against its documented API and has not been run)"


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed: the real build runs in test_tensorrt_engine")
def test_tensorrt_missing_says_how_to_install(tmp_path):
    from fuseinfer.export.cli import main
    from fuseinfer.export.tensorrt import unavailable_reason

    assert "pip install tensorrt" in unavailable_reason()
    assert main(["tensorrt", "--onnx", str(tmp_path), "--out", str(tmp_path / "e.plan")]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRT, reason=NO_TRT)
def test_tensorrt_engine(tmp_path):
    from fuseinfer.export.tensorrt import TrtDecoder, build_engine

    model = random_opt(dtype=torch.float16, device="cuda")
    to_onnx(model, tmp_path / "x", flavour="plain")
    engine = build_engine(tmp_path / "x", tmp_path / "e.plan", fp16=True, max_batch=2, max_len=64)
    ids = torch.randint(3, 500, (2, 9), device="cuda")
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
    got = TrtDecoder(engine, tmp_path / "x").logits(ids).float()
    assert (got - ref).abs().max() < 5e-2


# --- GPU: fp16 with the CUDA execution provider and IO binding

def _cuda_ort_reason():
    from fuseinfer.export.ort_runtime import unavailable_reason

    return unavailable_reason(torch.device("cuda")) if torch.cuda.is_available() else "no GPU"


def _fp16_check(tiny_model_path, tmp_path, flavour, device):
    """Export the tiny model in fp16 on ``device`` and run it there through IO binding (CPU provider or CUDA
    provider): logits within 2x PyTorch fp16's own error against fp32 (+ small atol), a left-padded batch,
    prefill + decode steps with the KV cache; the same code on CPU (CI) and on the GPU."""
    from transformers import AutoModelForCausalLM

    from fuseinfer.export.check import logit_errors, within_tolerance

    fp32 = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).to(device).eval()
    fp16 = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).to(device).eval()
    to_onnx(fp16, tmp_path / "x", flavour=flavour)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, fp32.config.vocab_size, (2, 40), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    try:
        dec = OrtDecoder(tmp_path / "x", device, model=fp16, flavour=flavour)
    except ExportError as exc:
        if device == "cpu" and "lack fp16 kernels" in str(exc):
            pytest.skip(f"this onnxruntime has no CPU fp16 kernels for the {flavour} graph: {exc}")
        raise
    errors = logit_errors(tmp_path / "x", fp32, fp16, device, ids, mask, prompt_len=32, decoder=dec)
    assert errors["padded"] and within_tolerance(errors), errors
    return dec


@pytest.mark.parametrize("flavour", ["fused", "plain"])
def test_cpu_fp16_io_binding_within_twice_pytorch_error(tiny_model_path, tmp_path, flavour):
    _fp16_check(tiny_model_path, tmp_path, flavour, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("flavour", ["fused", "plain"])
def test_cuda_fp16_within_twice_pytorch_error(tiny_model_path, tmp_path, flavour):
    """As the CPU test, with the CUDA provider: KV cache and logits stay on the GPU, ORT on its own stream."""
    reason = _cuda_ort_reason()
    if reason:
        pytest.skip(reason)
    dec = _fp16_check(tiny_model_path, tmp_path, flavour, "cuda")
    assert "CUDAExecutionProvider" in dec.session.get_providers() and dec.stream is not None


@pytest.mark.gpu
def test_cuda_export_opt125m_shapes_and_reuse(tmp_path):
    """A random opt-125m fp16 export runs batch 3 on CUDA and a fresh OrtDecoder re-loads it."""
    reason = _cuda_ort_reason()
    if reason:
        pytest.skip(reason)
    from fuseinfer.harness.models import load_config, load_model, resolve_model

    src = resolve_model("random:opt-125m")
    model = load_model(src, load_config(src), torch.float16, torch.device("cuda"), 0)
    to_onnx(model, tmp_path / "x")
    ids = torch.randint(3, 50000, (3, 17), device="cuda")
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, -1].float()
    got = OrtDecoder(tmp_path / "x", "cuda", model=model).logits(ids)[:, -1].float()
    assert (got - ref).abs().max() < 0.1


def test_model_left_untouched(tmp_path):
    """The exporter's mode juggling must not leave the model in training mode (dropout on), nor change weights."""
    model = random_opt(dropout=0.5)
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    to_onnx(model, tmp_path / "x", flavour="fused", dtype=torch.float32)
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_gpu_stage_scripts_run_on_cpu(tiny_exports, tmp_path):
    """The scripts tools/gpu_stage_export.sh runs once, blind, on the GPU (bench/ort_profile.py, the summary) run
    here on the CPU provider against the tiny exports: a Python error in them would cost the GPU run its figures."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "bench/ort_profile.py", str(tiny_exports["fused"][1]),
                          str(tiny_exports["plain"][1]), str(tmp_path / "ort_profile.md"), "16", "4"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    profile = json.loads((tmp_path / "ort_profile.json").read_text())
    assert set(profile) == {"fused", "plain"} and all(p["logits_finite"] for p in profile.values())
    assert profile["fused"]["ort_host_us"]["decode"]["MultiHeadAttention"] > 0
    fake = {"export_s": 1.0, "wall_s": 9.0, "load_s": 2.0, "dtype": "fp16", "contrib_ops": {"MultiHeadAttention": 4}}
    (tmp_path / "export_fused.json").write_text(json.dumps(fake))
    out = subprocess.run([sys.executable, "tools/export_stage_summary.py", str(tmp_path)], capture_output=True,
                         text=True, cwd=REPO, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "fused (fp16): to_onnx 1 s, whole CLI process 9 s" in out.stdout and "plain: no result" in out.stdout
    assert "fresh-process load" in out.stdout
