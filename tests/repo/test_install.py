"""The install: setup.py's choices (C++ standard, CUDA folders, CUTLASS, when to build), what it records for
``fuseinfer.extension_status()``, and the notes that name a slow W8A8 GEMM. All CPU-only: a real compile of
torch/extension.h with setup.py's flags (host compiler, seconds) stands in for the CUDA build."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fuseinfer
from fuseinfer.core import extension as _ext
# (the package exports the op function by the same name)
int8_gemm = importlib.import_module("fuseinfer.ops.w8a8_linear")

REPO = Path(__file__).resolve().parents[2]


def _load_setup():
    """setup.py's helpers, without building (setup() runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("fuseinfer_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_py = _load_setup()
CXX = shutil.which("c++") or shutil.which("g++")
STDS = {17: "201703L", 20: "202002L", 23: "202302L"}


@given(st.lists(st.sampled_from(sorted(STDS)), max_size=4), st.booleans(), st.text(alphabet="abc #\n", max_size=40))
def test_required_cxx_std_is_the_highest_guard(stds, by_value, noise):
    """Headers' `#error C++NN or later` guards (or their __cplusplus < value tests) set the standard; 17 at least."""
    texts = [noise]
    for std in stds:
        guard = (f"#if __cplusplus < {STDS[std]}\n" if by_value else "") + \
            f"#error C++{std} or later compatible compiler is required to use PyTorch.\n"
        texts.append(noise + guard)
    assert setup_py.required_cxx_std(texts) == max([17, *stds])


def _compile(source: str, include_dirs, flags) -> subprocess.CompletedProcess:
    """Syntax-check ``source`` as C++ with the host compiler."""
    cmd = [CXX, "-fsyntax-only", *flags, *(f"-I{d}" for d in include_dirs), "-x", "c++", "-"]
    return subprocess.run(cmd, input=source, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")
@pytest.mark.parametrize("std", [17, 20])  # (g++ 12's -std=c++23 still says __cplusplus 202100L)
def test_setup_flags_meet_a_newer_torch_headers_guard(tmp_path, std):
    """A torch whose headers demand C++20 (torch >= 2.14) gets that standard from setup.py: the hard-coded
    -std=c++17 stopped at this guard."""
    header = tmp_path / "torch" / "csrc" / "api" / "include" / "torch" / "all.h"
    header.parent.mkdir(parents=True)
    header.write_text(f"#pragma once\n#if __cplusplus < {STDS[std]}\n"
                      f"#error C++{std} or later compatible compiler is required to use PyTorch.\n#endif\n")
    flags = setup_py.cxx_flags(setup_py.torch_cxx_std(str(tmp_path)))
    assert f"-std=c++{std}" in flags
    proc = _compile("#include <torch/all.h>\nint main() { return 0; }\n", [header.parents[1]], flags)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")
def test_torch_extension_header_compiles_with_setup_flags():
    """The installed torch's <torch/extension.h> compiles with the flags setup.py chooses for it (host side)."""
    from torch.utils.cpp_extension import include_paths

    flags = setup_py.cxx_flags(setup_py.torch_cxx_std(include_paths()[0]))
    source = "#include <torch/extension.h>\nint main() { return at::ones({1}).numel() == 1 ? 0 : 1; }\n"
    proc = _compile(source, [*include_paths(), sysconfig.get_paths()["include"]], flags)
    assert proc.returncode == 0, f"{flags}: {proc.stderr[-3000:]}"


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def test_cuda_headers_come_from_the_toolkit_then_the_pip_wheels(tmp_path):
    """nvcc's toolkit (its targets/<arch>/include) first, then site-packages/nvidia/*/include for what it lacks;
    a folder named only by a wrapper script (CUDA_HOME=/usr/local) holds nothing."""
    toolkit, wrapper, sp = tmp_path / "cuda-13.0", tmp_path / "usr-local", tmp_path / "site-packages"
    _touch(toolkit / "targets" / "x86_64-linux" / "include" / "cuda_runtime.h")
    _touch(sp / "nvidia" / "cu13" / "include" / "cuda_runtime.h")
    _touch(sp / "nvidia" / "cu13" / "include" / "cublasLt.h")
    wrapper.mkdir()
    dirs = setup_py.cuda_include_dirs([str(toolkit), str(wrapper)], [str(sp)])
    assert dirs == [str(toolkit / "targets" / "x86_64-linux" / "include"), str(sp / "nvidia" / "cu13" / "include")]
    with pytest.raises(setup_py.BuildError, match="cuda_runtime.h not found"):
        setup_py.cuda_include_dirs([str(wrapper)], [])


def test_versioned_only_cuda_libraries_get_a_link(tmp_path):
    """The pip wheels ship libcublasLt.so.13 only, which -lcublasLt does not find: setup.py links it by name."""
    sp = tmp_path / "site-packages"
    lib = _touch(sp / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13")
    plain = _touch(tmp_path / "cuda" / "lib64" / "libcudart.so")
    dirs = setup_py.cuda_library_dirs([str(tmp_path / "cuda")], [str(sp)], ["cudart", "cublasLt"],
                                      str(tmp_path / "links"))
    assert dirs == [str(plain.parent), str(tmp_path / "links")]
    assert os.path.realpath(tmp_path / "links" / "libcublasLt.so") == str(lib)
    with pytest.raises(setup_py.BuildError, match="libnope.so not found"):
        setup_py.cuda_library_dirs([], [str(sp)], ["nope"], str(tmp_path / "links"))


def test_missing_cutlass_names_the_fix_and_the_opt_out(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(setup_py.BuildError) as info:
        setup_py.cutlass_include_dirs({})
    cause, fix = info.value.args
    assert "CUTLASS" in cause and "pip install nvidia-cutlass" in fix and "FUSEINFER_CUTLASS=0" in fix
    message = setup_py.failure(cause, fix)
    assert "\n" not in message and "FUSEINFER_BUILD_CUDA=0" in message


def _run_setup(tmp_path, mode: str) -> subprocess.CompletedProcess:
    """setup.py --name in a copy of the tree's build files (its _build_info.json lands in the copy)."""
    shutil.copy(REPO / "setup.py", tmp_path / "setup.py")
    (tmp_path / "fuseinfer").mkdir(exist_ok=True)
    env = {**os.environ, "FUSEINFER_BUILD_CUDA": mode}
    for knob in ("FUSEINFER_CUDA_ARCH", "TORCH_CUDA_ARCH_LIST"):
        env.pop(knob, None)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch")
def test_setup_records_why_it_installs_pure_python(tmp_path):
    """auto on a CPU torch: pure Python, the reason written for extension_status (pip hides setup.py's output)."""
    proc = _run_setup(tmp_path, "auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads((tmp_path / "fuseinfer" / "_build_info.json").read_text())
    assert info["built"] is False and "CPU build" in info["reason"]


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch")
def test_setup_forced_cuda_build_fails_with_one_message(tmp_path):
    proc = _run_setup(tmp_path, "1")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fuseinfer: cannot build the CUDA extension: ") and "FUSEINFER_BUILD_CUDA=0" in last


@pytest.fixture
def fresh_ext(monkeypatch, tmp_path):
    """_ext with nothing loaded yet, its build info read from tmp_path, fuseinfer._C absent."""
    monkeypatch.setattr(_ext, "_ext", None)
    monkeypatch.setattr(_ext, "_load_error", None)
    monkeypatch.setattr(_ext, "_warned", False)
    monkeypatch.setattr(_ext, "BUILD_INFO", tmp_path / "_build_info.json")
    monkeypatch.delenv("FUSEINFER_DISABLE_CUDA", raising=False)

    def absent(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(_ext.importlib, "import_module", absent)
    return tmp_path / "_build_info.json"


def test_extension_status_says_why_the_build_left_it_out(fresh_ext):
    fresh_ext.write_text(json.dumps({"built": False, "reason": "no GPU visible and no FUSEINFER_CUDA_ARCH given"}))
    status = fuseinfer.extension_status()
    assert status.startswith("not built: no GPU visible") and "Install" in status


@given(st.one_of(st.text(max_size=30), st.just('{"built": "yes"}'), st.just("[1]")))
def test_unreadable_build_info_is_ignored(text):
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"fuseinfer-build-info-{os.getpid()}.json"
    path.write_text(text)
    saved = _ext.BUILD_INFO
    try:
        _ext.BUILD_INFO = path
        info = _ext.build_info()
    finally:
        _ext.BUILD_INFO = saved
        path.unlink()
    assert info == {} or isinstance(info["built"], bool)


def test_gpu_op_without_the_extension_warns_once(fresh_ext):
    fresh_ext.write_text(json.dumps({"built": False, "reason": "torch 2.13.0+cpu is a CPU build"}))
    with pytest.warns(RuntimeWarning, match="CUDA extension is absent.*CPU build"):
        assert _ext.extension(torch.device("cuda")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ext.extension(torch.device("cuda")) is None
        assert _ext.extension(torch.device("cpu")) is None  # CPU ops never warn


class _Stub:
    """fuseinfer._C built without CUTLASS: the stub's reason (csrc/w8a8_linear_sm90.cu)."""

    @staticmethod
    def w8a8_linear_unavailable(index):
        return ("fuseinfer._C was built without CUTLASS (pip install nvidia-cutlass or set FUSEINFER_CUTLASS_DIR to a "
                "CUTLASS checkout, then rebuild: pip install --no-build-isolation -e .)")


@pytest.mark.parametrize("capability, slow", [((9, 0), True), ((8, 0), False)])
def test_w8a8_note_names_the_fallback_and_when_it_is_slow(monkeypatch, capability, slow):
    monkeypatch.setattr(int8_gemm, "extension", lambda device=None: _Stub)
    monkeypatch.setattr(int8_gemm, "_unavailable", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    note = int8_gemm.w8a8_gemm_note(torch.device("cuda", 0))
    assert note.startswith("W8A8 GEMM: torch._int_mm fallback (fuseinfer._C was built without CUTLASS")
    assert (int8_gemm.SLOW_ON_SM90 in note) == slow and "\n" not in note


def test_w8a8_note_fp32_and_cutlass_and_cpu(monkeypatch):
    assert int8_gemm.w8a8_gemm_note(torch.device("cpu")).startswith("W8A8 GEMM: PyTorch reference")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(int8_gemm, "w8a8_backend", lambda device, out_dtype=None: "cutlass-sm90")
    assert int8_gemm.w8a8_gemm_note(torch.device("cuda", 0)) == "W8A8 GEMM: CUTLASS sm_90 int8"
    monkeypatch.setattr(int8_gemm, "w8a8_backend", lambda device, out_dtype=None: "int_mm")
    note = int8_gemm.w8a8_gemm_note(torch.device("cuda", 0), torch.float32)
    assert int8_gemm.SLOW_ON_SM90 in note and "fp16 or bf16" in note


def test_w8a8_patch_report_and_eval_notes_name_the_gemm(tiny_model_path):
    """The patch report and the eval's notes say which GEMM the quantized linears run."""
    from transformers import AutoModelForCausalLM

    from fuseinfer.eval.report import _notes

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    data = tiny_model_path.parents[1] / "data" / "wikitext-2-raw"
    report = fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.SmoothQuantW8A8(
        calibration=str(data), samples=2, seq_len=64)))
    assert "W8A8 GEMM: PyTorch reference (cpu" in str(report)
    assert report.quant.gemm in _notes({"w8a8_gemm": report.quant.gemm})


# ---- the extension's ops register themselves (csrc/*.cu: TORCH_LIBRARY_FRAGMENT), no central list ----

CSRC = REPO / "csrc"
_SCHEMA = re.compile(r'm\.def\(\s*"(\w+)\(')


def _registered_ops() -> dict[str, list[str]]:
    """{op name: the csrc files whose TORCH_LIBRARY_FRAGMENT defines it}."""
    ops: dict[str, list[str]] = {}
    for path in sorted(CSRC.glob("*")):
        if path.suffix in (".cu", ".cpp"):
            for name in _SCHEMA.findall(path.read_text()):
                ops.setdefault(name, []).append(path.name)
    return ops


def _called_ops() -> dict[str, set[str]]:
    """{op name: the package files that call it on the extension} (``ext.<op>``, ``extension(...).<op>``,
    ``hasattr(ext, "<op>")``)."""
    pattern = re.compile(r'\b(?:ext|_extension|extension\([^()]*\))\.([a-z]\w*)\b'
                         r'|hasattr\((?:ext|_extension), "(\w+)"\)')
    calls: dict[str, set[str]] = {}
    for path in (REPO / "fuseinfer").rglob("*.py"):
        for match in pattern.finditer(path.read_text()):
            calls.setdefault(match.group(1) or match.group(2), set()).add(str(path.relative_to(REPO)))
    return calls


def test_every_op_the_package_calls_is_registered_once_in_csrc():
    """Each op is defined by exactly one csrc file, and every op the Python side calls on the extension (renamed
    ones included) is one of them."""
    ops = _registered_ops()
    assert {name: files for name, files in ops.items() if len(files) > 1} == {}
    called = _called_ops()
    assert {"add_layer_norm", "linear_epilogue", "w8a16_linear", "set_knobs"} <= called.keys()
    assert {name: sorted(files) for name, files in called.items() if name not in ops} == {}


def test_no_central_kernel_list():
    """No file binds or declares every kernel: the module file exports nothing, and no csrc file is a pybind11
    module listing functions."""
    module = (CSRC / "module.cpp").read_text()
    assert not set(_registered_ops()) & set(re.findall(r"\w+", module))
    for path in CSRC.glob("*"):
        assert "PYBIND11_MODULE" not in path.read_text(), path.name
    assert not (CSRC / "bindings.cpp").exists() and not (CSRC / "fuseinfer.h").exists()


def test_quantized_linear_files_are_named_after_their_ops():
    ops = _registered_ops()
    assert ops["w8a16_linear"] == ["w8a16_linear.cu"] and ops["w8a8_linear"] == ["w8a8_linear_sm90.cu"]
    # setup.py's CUTLASS gating and the per-dtype split are documented against these names
    assert (CSRC / "w8a8_linear_sm90_bf16.cu").exists() and (CSRC / "w8a8_linear_sm90.cuh").exists()


def test_kernels_resolve_registered_ops_once():
    """_ext.Kernels: an op of its namespace is its OpOverload, cached as an attribute; a missing one is an
    AttributeError, so hasattr() reports it (an extension older than the package)."""
    lib = torch.library.Library("fuseinfer_test_kernels", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    kernels = _ext.Kernels("fuseinfer_test_kernels")
    assert torch.equal(kernels.twice(torch.ones(2)), torch.full((2,), 2.0))
    assert isinstance(kernels.twice, torch._ops.OpOverload) and "twice" in vars(kernels)
    assert not hasattr(kernels, "thrice") and not hasattr(kernels, "__deepcopy__")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")
def test_host_ops_register_themselves_when_the_module_is_imported(tmp_path):
    """csrc's host-only files (the module, knobs, path counts) built with the host compiler into an importable _C:
    importing it registers their ops, and _ext.Kernels calls them through the dispatcher (a dict in and out)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    flags = setup_py.cxx_flags(setup_py.torch_cxx_std(include_paths()[0]))
    lib = library_paths()[0]
    out = tmp_path / "_C.so"
    cmd = [CXX, "-shared", "-fPIC", "-O0", *[f for f in flags if not f.startswith("-O")], "-DTORCH_EXTENSION_NAME=_C",
           *(f"-I{d}" for d in [*include_paths(), sysconfig.get_paths()["include"]]),
           *(str(CSRC / n) for n in ("module.cpp", "knobs.cpp", "path_counts.cpp")),
           f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("_C", {str(out)!r})
spec.loader.exec_module(importlib.util.module_from_spec(spec))
from fuseinfer.core.extension import Kernels
k = Kernels()
counts = k.path_counts()
assert isinstance(counts, dict) and counts["linear.skinny"] == 0 and len(counts) == 12, counts
k.set_knobs({{"FUSEINFER_PDL": 0, "FUSEINFER_GEMM_TUNE": 1}})
try:
    k.set_knobs({{"FUSEINFER_NOT_A_KNOB": 1}})
except RuntimeError as exc:
    assert "unknown knob FUSEINFER_NOT_A_KNOB" in str(exc), exc
else:
    raise AssertionError("an unknown knob was accepted")
assert not hasattr(k, "add_layer_norm")  # (not in this build)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_every_public_name_exists_and_the_version_is_setup_pys():
    """Each name in ``fuseinfer.__all__`` resolves (a name lost from the package's __init__ fails here), and
    ``fuseinfer.__version__`` is the version setup.py installs."""
    import re

    import fuseinfer

    missing = [name for name in fuseinfer.__all__ if not hasattr(fuseinfer, name)]
    assert missing == []
    version = re.search(r'version="([^"]+)"', (REPO / "setup.py").read_text()).group(1)
    assert fuseinfer.__version__ == version
