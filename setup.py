"""Build script: installs the fuseinfer package and, when it can, the CUDA extension ``fuseinfer._C``.

Build knobs (environment variables):
  FUSEINFER_BUILD_CUDA   auto (default): build the extension when torch has CUDA and nvcc is found, else
                         install pure Python; 1: build it or fail; 0: never build it.
  FUSEINFER_CUDA_ARCH    compute capabilities to compile for, ';'-separated (default: TORCH_CUDA_ARCH_LIST if set,
                         else "9.0a", the H100/H200 with their sm_90a-only instructions, which the wgmma attention
                         prefill needs; without "9.0a", or with a plain "9.0" beside it, that kernel is left out and
                         the mma.sync one runs; e.g. "8.0;9.0a" for A100 and H100). Sets TORCH_CUDA_ARCH_LIST. On a
                         GPU the build has no kernels for, the ops run their PyTorch references and the patch
                         report says so.
  MAX_JOBS               parallel compile jobs (torch's own knob; default: torch's choice).
  FUSEINFER_CUTLASS_DIR  CUTLASS headers for the sm_90 W8A8 int8 GEMM (csrc/w8a8_gemm_sm90*.cu): a CUTLASS checkout
                         (include/cutlass/cutlass.h) or an unpacked nvidia-cutlass wheel (cutlass_library/source);
                         default: the installed nvidia-cutlass package, if any. Without CUTLASS that op is compiled
                         as a stub that says so, and fuseinfer.ops.w8a8_linear takes its torch._int_mm fallback.

torch must be importable at build time for the extension, so build it with
``pip install --no-build-isolation -e .``; under build isolation torch is absent and the install is pure Python.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

MODE = os.environ.get("FUSEINFER_BUILD_CUDA", "auto").lower()
if MODE not in ("auto", "0", "1"):
    raise SystemExit(f"FUSEINFER_BUILD_CUDA must be auto, 0 or 1, got {MODE!r}")


def cutlass_include_dirs():
    """[CUTLASS include, CUTLASS tools/util/include] from $FUSEINFER_CUTLASS_DIR or the installed nvidia-cutlass
    package (found without importing it), or [] with the reason printed."""
    import importlib.util

    root = os.environ.get("FUSEINFER_CUTLASS_DIR")
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
        raise SystemExit(f"FUSEINFER_CUTLASS_DIR={root} holds no CUTLASS headers (include/cutlass/cutlass.h and "
                         "tools/util/include, or cutlass_library/source/... of the nvidia-cutlass wheel)")
    print("fuseinfer: CUTLASS not found (pip install nvidia-cutlass or set FUSEINFER_CUTLASS_DIR): the W8A8 int8 "
          "GEMM is built as a stub and w8a8_linear falls back to torch._int_mm")
    return []


def cuda_extension():
    """The CUDAExtension to build, or None with the reason printed."""
    if MODE == "0":
        return None
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        reason = "torch is not importable at build time (use pip install --no-build-isolation)"
    else:
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} is a CPU build"
        elif CUDA_HOME is None and shutil.which("nvcc") is None:
            reason = "nvcc not found (set CUDA_HOME)"
        else:
            arch = os.environ.get("FUSEINFER_CUDA_ARCH") or os.environ.get("TORCH_CUDA_ARCH_LIST") or "9.0a"
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
            archs = [a.split("+")[0] for a in arch.replace(" ", ";").split(";")]
            # the wgmma kernel only where an sm_90 GPU is sure to load the sm_90a code (no plain 9.0 beside it)
            defines = ["-DFUSEINFER_SM90A"] if "9.0a" in archs and "9.0" not in archs else []
            # CUTLASS (the W8A8 GEMM): its headers, and FUSEINFER_CUTLASS so that file compiles its kernels (sm_90a
            # turns on CUTLASS_ARCH_MMA_SM90A_ENABLED by itself through __CUDA_ARCH_FEAT_SM90_ALL)
            cutlass = cutlass_include_dirs()
            cutlass_defines = ["-DFUSEINFER_CUTLASS"] if cutlass else []
            nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo",
                          "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                          "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"] + defines \
                + cutlass_defines
            ext = CUDAExtension(
                "fuseinfer._C",
                sources=sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu")),
                include_dirs=[os.path.abspath("csrc")] + cutlass,
                extra_compile_args={"cxx": ["-O3", "-std=c++17"] + defines, "nvcc": nvcc_flags},
                libraries=["cublasLt"],
            )
            return ext, BuildExtension
    if MODE == "1":
        raise SystemExit(f"FUSEINFER_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
    print(f"fuseinfer: installing pure Python, no CUDA extension: {reason}")
    return None


built = cuda_extension()
setup(
    name="fuseinfer",
    version="0.2.0",
    description="Fused CUDA ops for Hugging Face OPT inference: patch and measure",
    packages=find_packages(include=["fuseinfer", "fuseinfer.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "transformers>=5.17,<5.24", "safetensors", "rich", "numpy"],
    extras_require={"test": ["pytest>=8", "matplotlib", "hypothesis>=6", "onnx>=1.16", "onnxruntime>=1.20",
                             "onnxscript", "accelerate>=1.0"],
                    "multi-gpu": ["accelerate>=1.0"],
                    "plot": ["matplotlib"],
                    "export": ["onnx>=1.16", "onnxruntime>=1.20"],  # CUDA: onnxruntime-gpu instead
                    # attention_backend="flash_attn" (docs/attention_backends.md): flash-attn-4 and its deps, pinned;
                    # the -libs-cu13 flavour matches torch's CUDA 13 builds (the -libs-cu12 one is the default)
                    "flash-attn": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]==4.8.1",
                                   "nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-core==4.8.1",
                                   "nvidia-cutlass-dsl-libs-cu13==4.8.1", "quack-kernels==0.6.5",
                                   "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5", "einops==0.8.2"],
                    "w8a8": ["nvidia-cutlass>=4.2"]},  # build-time headers of the sm_90 int8 GEMM
    ext_modules=[built[0]] if built else [],
    cmdclass={"build_ext": built[1]} if built else {},
)
