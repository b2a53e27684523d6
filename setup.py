"""Build script: installs the fuseinfer package and, when asked or when a GPU is there to use it, the CUDA extension
``fuseinfer._C``.

Build knobs (environment variables):
  FUSEINFER_BUILD_CUDA   auto (default): build the extension when torch has CUDA, nvcc is found and either a GPU is
                         visible or an arch list is given (FUSEINFER_CUDA_ARCH / TORCH_CUDA_ARCH_LIST), else install
                         pure Python (a build for no GPU would be a guess at its architecture);
                         1: build it or fail; 0: never build it.
  FUSEINFER_CUDA_ARCH    compute capabilities to compile for, ';'-separated (default: TORCH_CUDA_ARCH_LIST if set,
                         else the visible GPUs' own, with "9.0a" for H100/H200, else "9.0a"). "9.0a" (sm_90a-only
                         instructions) is what the wgmma attention prefill and the CUTLASS W8A8 GEMM need; with a
                         plain "9.0" beside it those kernels are left out; e.g. "8.0;9.0a" for A100 and H100. On a GPU
                         the build has no kernels for, the ops run their PyTorch references and the patch report says
                         so.
  FUSEINFER_CUTLASS      auto (default): a build for sm_90a needs CUTLASS's headers (the W8A8 int8 GEMM) and fails
                         without them; 0: build without them (W8A8 linears then take torch._int_mm, slower).
  FUSEINFER_CUTLASS_DIR  CUTLASS headers: a CUTLASS checkout (include/cutlass/cutlass.h) or an unpacked
                         nvidia-cutlass wheel (cutlass_library/source); default: the installed nvidia-cutlass package.
  MAX_JOBS               parallel compile jobs (torch's own knob; default: torch's choice).

The extension must be compiled against the torch that will run it, so build it with
``pip install --no-build-isolation ...``; under build isolation pip builds against a throwaway torch (or none) and the
install is pure Python. What the build decided (built or not, and why) is written to fuseinfer/_build_info.json,
which ``fuseinfer.extension_status()`` reports: pip shows this script's output only when it fails or with -v.
"""
import glob
import json
import os
import re
import shutil
import site
import sys
import sysconfig

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join(HERE, "fuseinfer", "_build_info.json")
OPT_OUT = "FUSEINFER_BUILD_CUDA=0 (pure Python: every op runs its PyTorch reference)"


class BuildError(Exception):
    """What stops a CUDA build: ``BuildError(cause, fix)``; ``failure(*exc.args)`` is the message the user sees."""


def failure(cause: str, fix: str) -> str:
    """The one message a failed CUDA build stops with: the cause and the two ways out."""
    return f"fuseinfer: cannot build the CUDA extension: {cause}. Fix: {fix}; or install without it: {OPT_OUT}."


def build_mode(env=os.environ) -> str:
    mode = env.get("FUSEINFER_BUILD_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"fuseinfer: FUSEINFER_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    return mode


_STD_RE = re.compile(r"#\s*error\s+C\+\+(\d\d)\s+or later|__cplusplus\s*<\s*(\d{6})L")


def required_cxx_std(header_texts) -> int:
    """The C++ standard torch's headers demand (their ``#error C++NN or later ...`` guards), at least 17."""
    std = 17
    for text in header_texts:
        for named, value in _STD_RE.findall(text):
            # 201703L -> 17, 202002L -> 20, 202302L -> 23
            std = max(std, int(named) if named else int(value[2:4]))
    return std


def torch_cxx_std(torch_include: str) -> int:
    """``required_cxx_std`` of the torch whose headers are in ``torch_include`` (torch/extension.h pulls in both)."""
    texts = []
    for rel in ("torch/csrc/api/include/torch/all.h", "ATen/ATen.h"):
        path = os.path.join(torch_include, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    return required_cxx_std(texts)


def cxx_flags(std: int) -> list:
    """The host compiler flags fuseinfer's C++ sources build with, for C++ standard ``std`` (``torch_cxx_std``);
    tests/repo/test_install.py compiles torch/extension.h with them."""
    return ["-O3", f"-std=c++{std}"]


def site_dirs() -> list:
    """site-packages folders, where the nvidia-* CUDA wheels (torch's dependencies) put headers and libraries."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def nvcc_root(nvcc: str):
    """The toolkit folder ``nvcc`` really runs from (its TOP; CUDA_HOME may be a folder holding a wrapper script
    only, e.g. /usr/local for /usr/local/bin/nvcc), or None."""
    import subprocess

    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    top = re.search(r"^#\$ TOP=(.*)$", out.stdout + out.stderr, re.M)
    return os.path.realpath(top.group(1).strip()) if top else None


def cuda_search_dirs(roots, sites, kind: str) -> list:
    """Folders that may hold the CUDA ``kind`` ("include" or "lib"): the toolkits' in ``roots`` first (nvcc's own,
    whose headers match it), then the pip wheels' (site-packages/nvidia/<pkg>/include, .../lib: nvidia-cuda-runtime,
    nvidia-cublas, ...)."""
    dirs = []
    for root in filter(None, roots):
        names = ["include"] if kind == "include" else ["lib64", "lib"]
        dirs += [os.path.join(root, n) for n in names]
        dirs += sorted(glob.glob(os.path.join(root, "targets", "*", kind)))
    for sp in sites:
        dirs += sorted(glob.glob(os.path.join(sp, "nvidia", "*", kind)))
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def cuda_include_dirs(roots, sites, headers=("cuda_runtime.h", "cublasLt.h")) -> list:
    """The folders that hold ``headers``, one per header (first match), or BuildError naming the missing one."""
    found = []
    candidates = cuda_search_dirs(roots, sites, "include")
    for header in headers:
        hit = next((d for d in candidates if os.path.isfile(os.path.join(d, header))), None)
        if hit is None:
            raise BuildError(f"{header} not found (looked in {', '.join(candidates) or 'no CUDA folder'})",
                             "install the CUDA toolkit's headers (a CUDA torch from pip brings them as nvidia-* "
                             "packages) or set CUDA_HOME to a full toolkit")
        found.append(hit)
    return list(dict.fromkeys(found))


def cuda_library_dirs(roots, sites, libs, link_dir: str) -> list:
    """Folders to link ``libs`` (e.g. cudart, cublasLt) from. The pip wheels ship only versioned names
    (libcublasLt.so.13), which ``-lcublasLt`` does not find: those get an unversioned symlink in ``link_dir``."""
    out = []
    candidates = cuda_search_dirs(roots, sites, "lib")
    for lib in libs:
        plain = next((d for d in candidates if os.path.exists(os.path.join(d, f"lib{lib}.so"))), None)
        if plain:
            out.append(plain)
            continue
        versioned = sorted((p for d in candidates for p in glob.glob(os.path.join(d, f"lib{lib}.so.*"))), key=len)
        if not versioned:
            raise BuildError(f"lib{lib}.so not found (looked in {', '.join(candidates) or 'no CUDA folder'})",
                             "install the CUDA toolkit's libraries or set CUDA_HOME to a full toolkit")
        os.makedirs(link_dir, exist_ok=True)
        link = os.path.join(link_dir, f"lib{lib}.so")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(versioned[0], link)
        out.append(link_dir)
    return list(dict.fromkeys(out))


def requested_arch(env=os.environ):
    """The arch list the user gave (FUSEINFER_CUDA_ARCH, else TORCH_CUDA_ARCH_LIST), or None."""
    return env.get("FUSEINFER_CUDA_ARCH") or env.get("TORCH_CUDA_ARCH_LIST") or None


def visible_arch(torch) -> str:
    """The visible GPUs' architectures as an arch list ("9.0a" for sm_90: the H100/H200 kernels need it), or ""."""
    if not torch.cuda.is_available():
        return ""
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "") for major, minor in caps)


def arch_names(arch: str) -> list:
    return [a.split("+")[0] for a in arch.replace(" ", ";").split(";") if a]


def cutlass_include_dirs(env=os.environ):
    """[CUTLASS include, CUTLASS tools/util/include] from $FUSEINFER_CUTLASS_DIR or the installed nvidia-cutlass
    package (found without importing it), or BuildError naming the fix."""
    import importlib.util

    root = env.get("FUSEINFER_CUTLASS_DIR")
    if root:
        roots = [root, os.path.join(root, "cutlass_library", "source"), os.path.join(root, "source")]
    else:
        spec = importlib.util.find_spec("cutlass_library")
        roots = [os.path.join(p, "source") for p in (spec.submodule_search_locations or [])] if spec else []
    for r in roots:
        include = os.path.join(r, "include")
        util = os.path.join(r, "tools", "util", "include")
        if os.path.isfile(os.path.join(include, "cutlass", "cutlass.h")) and os.path.isdir(util):
            return [os.path.abspath(include), os.path.abspath(util)]
    if root:
        raise BuildError(f"FUSEINFER_CUTLASS_DIR={root} holds no CUTLASS headers (include/cutlass/cutlass.h and "
                         "tools/util/include, or cutlass_library/source/... of the nvidia-cutlass wheel)",
                         "point FUSEINFER_CUTLASS_DIR at a CUTLASS checkout, or unset it and pip install nvidia-cutlass")
    raise BuildError("CUTLASS headers not found (the sm_90 W8A8 int8 GEMM is built from them)",
                     "pip install nvidia-cutlass (or set FUSEINFER_CUTLASS_DIR), or build without that GEMM with "
                     "FUSEINFER_CUTLASS=0 (W8A8 prefill then runs torch._int_mm, slower than fp16)")


def write_build_info(info: dict) -> None:
    """fuseinfer/_build_info.json (atomically): what this build decided, for ``fuseinfer.extension_status()``."""
    tmp = BUILD_INFO + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    os.replace(tmp, BUILD_INFO)


def skip(mode: str, reason: str, fix: str):
    """Not building: pure Python in auto mode (the reason recorded for extension_status), an error under 1."""
    if mode == "1":
        raise SystemExit(failure(reason, fix))
    print(f"fuseinfer: installing pure Python, no CUDA extension: {reason}", file=sys.stderr)
    write_build_info({"built": False, "reason": reason})
    return None


def cuda_extension(mode: str):
    """(CUDAExtension, its build_ext class) to build, or None (pure Python) with the reason recorded."""
    if mode == "0":
        return skip(mode, "FUSEINFER_BUILD_CUDA=0", "")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension, include_paths
    except ImportError:
        return skip(mode, "torch was not importable at build time (pip's build isolation)",
                    "install torch first, then pip install --no-build-isolation")
    if torch.version.cuda is None:
        return skip(mode, f"torch {torch.__version__} is a CPU build", "install a CUDA build of torch")
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return skip(mode, "nvcc not found", "install the CUDA toolkit (or pip install nvidia-cuda-nvcc) and set "
                                            "CUDA_HOME")
    arch = requested_arch() or visible_arch(torch)
    if not arch:
        if mode == "auto":
            return skip(mode, "no GPU visible and no FUSEINFER_CUDA_ARCH given", "")
        arch = "9.0a"
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    archs = arch_names(arch)
    try:
        roots = list(dict.fromkeys([nvcc_root(nvcc), CUDA_HOME]))
        include = cuda_include_dirs(roots, site_dirs())
        libs = cuda_library_dirs(roots, site_dirs(), ["cudart", "cublasLt"],
                                 os.path.join(HERE, "build", "cuda-link"))
        # the wgmma kernel only where an sm_90 GPU is sure to load the sm_90a code (no plain 9.0 beside it)
        sm90a = "9.0a" in archs and "9.0" not in archs
        want_cutlass = sm90a and os.environ.get("FUSEINFER_CUTLASS", "auto").lower() != "0"
        cutlass = cutlass_include_dirs() if want_cutlass else []
    except BuildError as exc:
        raise SystemExit(failure(*exc.args)) from None
    defines = ["-DFUSEINFER_SM90A"] if sm90a else []
    # FUSEINFER_CUTLASS makes csrc/w8a8_linear_sm90*.cu compile their kernels (sm_90a turns on
    # CUTLASS_ARCH_MMA_SM90A_ENABLED by itself through __CUDA_ARCH_FEAT_SM90_ALL); without it they are stubs that
    # say why, and w8a8_linear takes torch._int_mm
    cutlass_defines = ["-DFUSEINFER_CUTLASS"] if cutlass else []
    std = torch_cxx_std(include_paths()[0])
    cxx = cxx_flags(std)
    nvcc_flags = cxx + ["--expt-relaxed-constexpr", "-lineinfo",
                        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"] + defines + cutlass_defines
    ext = CUDAExtension(
        "fuseinfer._C",
        sources=sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu")),
        include_dirs=[os.path.abspath("csrc")] + include + cutlass,
        library_dirs=libs,
        extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc_flags},
        libraries=["cublasLt"],
    )

    class Build(BuildExtension):
        """torch's BuildExtension, stopping with one message when the compiler fails."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as exc:  # the compiler's own errors are printed above this message
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                write_build_info({"built": False, "reason": f"compiling the CUDA extension failed ({first})"})
                raise SystemExit(failure(f"compiling it failed ({first}; the compiler's errors are above)",
                                         f"fix the toolchain (nvcc {torch.version.cuda}, a host compiler with "
                                         f"C++{std})")) from None

    write_build_info({"built": True, "cuda_arch": arch, "cutlass": bool(cutlass), "cxx_std": std,
                      "torch": torch.__version__})
    return ext, Build


if __name__ == "__main__":  # (tests/repo/test_install.py imports the helpers above without building)
    built = cuda_extension(build_mode())
    setup(
        name="fuseinfer",
        version="0.2.0",
        description="Fused CUDA ops for Hugging Face OPT inference: patch and measure",
        packages=find_packages(include=["fuseinfer", "fuseinfer.*"]),
        package_data={"fuseinfer": ["_build_info.json"]},
        python_requires=">=3.10",
        install_requires=["torch>=2.11", "transformers>=5.17,<5.24", "safetensors", "rich", "numpy"],
        extras_require={"test": ["pytest>=8", "matplotlib", "hypothesis>=6", "onnx>=1.16", "onnxruntime>=1.20",
                                 "onnxscript", "accelerate>=1.0",
                                 "parameterized"],  # (transformers' own model tests, tests/third_party/)
                        "multi-gpu": ["accelerate>=1.0"],
                        "plot": ["matplotlib"],
                        "export": ["onnx>=1.16", "onnxruntime>=1.20"],  # CUDA: onnxruntime-gpu instead
                        # attention_backend="flash_attn" (docs/attention_backends.md): flash-attn-4 and its deps,
                        # pinned; the -libs-cu13 flavour matches torch's CUDA 13 builds (-libs-cu12 is the default)
                        "flash-attn": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]==4.8.1",
                                       "nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-core==4.8.1",
                                       "nvidia-cutlass-dsl-libs-cu13==4.8.1", "quack-kernels==0.6.5",
                                       "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5", "einops==0.8.2"],
                        "w8a8": ["nvidia-cutlass>=4.2"]},  # build-time headers of the sm_90 int8 GEMM
        ext_modules=[built[0]] if built else [],
        cmdclass={"build_ext": built[1]} if built else {},
    )
