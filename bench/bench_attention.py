"""Benchmark of fuseinfer's attention kernel (fuseinfer_C::attention) against PyTorch's SDPA backends.

Prefill rows: causal self-attention, q = k = v length S, fp16, reported in TFLOP/s with the causal count
4 * B * H * S^2 * D / 2 (two GEMMs of 2*S*S*D FLOPs each, half of them above the diagonal skipped).
Decode rows: one query over a KV cache of `ctx` keys, reported in GB/s of (K + V + q + out) bytes and as a
percentage of the device-to-device copy ceiling measured in the same run.

On an sm_90 GPU the prefill rows also time fuseinfer's mma.sync kernel (`fuseinfer_mma_sync`, FUSEINFER_ATTN_SM90=0)
and its FP8 prefill (`fuseinfer_fp8`, FUSEINFER_ATTN_FP8=1: the e4m3 prep of k and v included) next to the default
wgmma one (`fuseinfer`); the FP8 rows are checked against MAX_ERR_FP8 (e4m3 keeps 3 mantissa bits).

`flash_attn` is the flash-attn-4 package (FlashAttention's CuTe-DSL kernels, `pip install fuseinfer[flash-attn]`)
called through fuseinfer's own mapping (`fuseinfer.ops.flash_attention`, what `attention_backend="flash_attn"` runs),
so its rows include that mapping's copies; when the package does not import, the column is skipped and the reason is
printed and recorded (settings.flash_attn). Padded rows (`prefill_padded`, `decode_padded`) are left-padded batches
(row b keeps S - b*S/(2B) real tokens) with a (B, Skv) key mask, as a padded batch reaches the patched model: q, k, v
are views of one (B, S, 3, H, D) q/k/v GEMM output for prefill; decode reads a (B, H, ctx, D) cache. Their TFLOP/s
count the real tokens only: sum over rows of 4*H*L_b^2*D/2; their GB/s the real keys' K + V bytes plus q and out.
SDPA gets the (B, 1, Sq, Skv) boolean mask there (its flash backend takes no mask: recorded as unavailable).
After the run, the (phase, head dim) classes where `flash_attn` was faster than `fuseinfer` in every row are printed
as the rows for `fuseinfer.layers.attention_backend.AUTO_TABLE` (and saved as settings.auto_table_measured).

Baselines: torch.nn.functional.scaled_dot_product_attention under each available SDPA backend (flash,
efficient, cudnn; a backend that rejects the inputs is recorded as unavailable) and torch.compile of the eager
math (softmax(q k^T * scale) v). Every implementation is checked against the eager math in fp32 before it is
timed; a wrong result aborts the run, so no speed is ever reported for a wrong kernel. The implementations are
timed in turn, once per round over --rounds rounds (drift between them cancels); a row reports the median of its
rounds and "speedup_vs_best_sdpa" the median over rounds of (that round's fastest SDPA backend) / (this one).

    python bench/bench_attention.py [--quick] [--rounds 5] [--no-flash-attn] [--prefill-only]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import bench_ms, measure_ceilings, paired_ratio, round_stats, write_results  # noqa: E402

from fuseinfer.core import knobs  # noqa: E402
from fuseinfer.ops import flash_attention as fa_op  # noqa: E402
from fuseinfer.ops.attention import allowed_mask  # noqa: E402

SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
DTYPE = torch.float16
MAX_ERR = 2e-2  # |impl - fp32 math| on unit-variance random inputs; fp16 kernels land near 1e-3
EXPECTED_PATH = {"fuseinfer_fp8": "attention.wgmma_fp8", "fuseinfer_mma_sync": "attention.mma_sync"}
MAX_ERR_FP8 = 0.3  # the same for the FP8 prefill: e4m3's step is 1/8 of a value's power of two (|out| up to ~3)
SCORE_BYTES_LIMIT = 12 << 30  # skip torch.compile(math) when its fp32 score matrix would exceed this


def math_attention(q, k, v, scale: float, causal: bool):
    """Eager math, (B, H, Sq, D) -> (B, H, Sq, D); causal is bottom-right aligned like fuseinfer's default."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        sq, skv = q.shape[2], k.shape[2]
        keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(skv - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(s.softmax(-1).to(q.dtype), v)


def implementations(q, k, v, scale: float, causal: bool, ext, key_mask=None, flash: bool = False) -> dict:
    """name -> (callable returning (B, Sq, H, D), context manager factory or None). ``key_mask`` (B, Skv): padded
    rows (fuseinfer and flash_attn take it per row, SDPA as a boolean mask; no compile_math)."""
    # the 16-bit kernels whatever FUSEINFER_ATTN_FP8 says; the FP8 prefill in a column of its own
    impls = {"fuseinfer": (lambda: ext.attention(q, k, v, key_mask, None, scale), lambda: knobs.override(ATTN_FP8="0"))}
    if causal and ext.attention_prefill_kernel() in ("wgmma", "wgmma_fp8"):  # the mma.sync prefill it replaces
        impls["fuseinfer_mma_sync"] = (lambda: ext.attention(q, k, v, key_mask, None, scale),
                                       lambda: knobs.override(ATTN_SM90="0", ATTN_FP8="0"))
        impls["fuseinfer_fp8"] = (lambda: ext.attention(q, k, v, key_mask, None, scale),
                                  lambda: knobs.override(ATTN_FP8="1"))
    if flash:  # the package through fuseinfer's mapping (checked to take the flash-attn-4 path in check_flash)
        impls["flash_attn"] = (lambda: fa_op.flash_attention_cuda(q, k, v, key_mask, None, scale), None)
    b, h, sq, _ = q.shape
    if key_mask is not None:
        allowed = allowed_mask(key_mask, None, b, sq, k.shape[2], q.device)  # (B, 1, Sq, Skv)
        for name, backend in SDPA_BACKENDS.items():
            impls[name] = (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
                           .transpose(1, 2), lambda backend=backend: sdpa_kernel(backend))
        return impls
    torch.compiler.reset()  # a fresh compile per shape, never the recompile limit's silent eager fallback
    compiled_math = torch.compile(math_attention, dynamic=False)
    for name, backend in SDPA_BACKENDS.items():
        impls[name] = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(1, 2),
                       lambda backend=backend: sdpa_kernel(backend))
    if b * h * sq * k.shape[2] * 4 <= SCORE_BYTES_LIMIT:
        impls["compile_math"] = (lambda: compiled_math(q, k, v, scale, causal).transpose(1, 2), None)
    return impls


def left_pads(b: int, s: int) -> torch.Tensor:
    """(B,) left-padding lengths of a padded batch: row i keeps S - i*S/(2B) real tokens."""
    return torch.tensor([i * s // (2 * b) for i in range(b)], device="cuda")


def run_config(mode: str, b: int, h: int, sq: int, skv: int, d: int, ext, ceilings: dict, timing: dict,
               rounds: int, flash: bool = False) -> list[dict]:
    from fuseinfer.ops.attention import attention_ref

    torch.manual_seed(0)
    padded = mode.endswith("_padded")
    if padded and sq > 1:  # q, k, v: views of one q/k/v GEMM output, as the patched model hands them over
        qkv = torch.randn(b, sq, 3, h, d, device="cuda", dtype=DTYPE)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, S, D) strided
    else:
        q = torch.randn(b, h, sq, d, device="cuda", dtype=DTYPE)
        k = torch.randn(b, h, skv, d, device="cuda", dtype=DTYPE)
        v = torch.randn(b, h, skv, d, device="cuda", dtype=DTYPE)
    scale = d ** -0.5
    causal = mode.startswith("prefill")  # decode: one query sees every key (fuseinfer's default q_start = Skv - 1)
    key_mask = None
    if padded:
        pads = left_pads(b, skv)  # (B,)
        key_mask = torch.arange(skv, device="cuda")[None] >= pads[:, None]  # (B, Skv)
        ref = attention_ref(q.float(), k.float(), v.float(), key_mask, None, scale).float()  # (B, Sq, H, D)
        real = (skv - pads).double()  # (B,) real keys per row
        # SDPA gives NaN on the padded queries (no key); they are compared on the real ones (the kernels' zeros
        # there are checked in check_flash / the semantics check)
        real_q = (torch.arange(sq, device="cuda") + skv - sq)[None] >= pads[:, None]  # (B, Sq)
    else:
        ref = math_attention(q.float(), k.float(), v.float(), scale, causal).transpose(1, 2)  # (B, Sq, H, D)
        real = torch.full((b,), float(skv), dtype=torch.double)
        real_q = torch.ones(b, sq, dtype=torch.bool, device="cuda")

    if causal:  # real query/key pairs on or below the diagonal: 4*H*L^2*D/2 per row
        work = float((4 * h * real.square() * d / 2).sum())
    else:  # K + V of the real keys read, q read, out written
        work = float((2 * h * real * d).sum() + 2 * b * h * sq * d) * q.element_size()
    base = dict(mode=mode, B=b, H=h, Sq=sq, Skv=skv, D=d)
    rows, timed = [], {}  # timed: name -> (fn, ctx, err) of the implementations that ran and were right
    for name, (fn, ctx) in implementations(q, k, v, scale, causal, ext, key_mask, flash).items():
        try:
            with ctx() if ctx else _null():
                before = ext.path_counts()
                out = fn()
                torch.cuda.synchronize()
                taken = {p for p, n in ext.path_counts().items() if n != before[p]}
            if name in EXPECTED_PATH and EXPECTED_PATH[name] not in taken:  # a silent fallback is not timed as it
                raise AssertionError(f"{name} {base}: took {sorted(taken)}, not {EXPECTED_PATH[name]}")
        except Exception as exc:  # backend unavailable for these inputs / this GPU (flash-attn-4 raises other types too)
            if name.startswith("fuseinfer"):
                raise
            rows.append({**base, "impl": name, "note": f"unavailable: {_first_line(exc)}"})
            continue
        err = (out.float() - ref)[real_q].abs().nan_to_num(float("inf")).max().item()
        limit = MAX_ERR_FP8 if name == "fuseinfer_fp8" else MAX_ERR
        if not err <= limit:  # also catches NaN
            if name.startswith("fuseinfer"):
                raise AssertionError(f"{name} {base}: max abs error {err:.3g} > {limit}")
            rows.append({**base, "impl": name, "max_abs_err": err, "note": "wrong result, not timed"})
            continue
        timed[name] = (fn, ctx, err)
    # every implementation once per round, `rounds` rounds: clock and thermal drift hits all of them alike
    per_round = {name: [] for name in timed}
    for _ in range(rounds):
        for name, (fn, ctx, _err) in list(timed.items()):
            try:
                with ctx() if ctx else _null():
                    per_round[name].append(bench_ms(fn, **timing)["median_ms"])
            except Exception as exc:  # a baseline that ran once but fails under repetition
                if name.startswith("fuseinfer"):
                    raise
                rows.append({**base, "impl": name, "note": f"failed while timed: {_first_line(exc)}"})
                del timed[name], per_round[name]
    sdpa = [name for name in timed if name.startswith("sdpa")]
    best_sdpa = round_stats([min(per_round[other][i] for other in sdpa) for i in range(rounds)]) if sdpa else None
    for name, (_fn, _ctx, err) in timed.items():
        row = {**base, "impl": name, **round_stats(per_round[name]), "max_abs_err": err}
        sec = row["median_ms"] * 1e-3
        if causal:
            row["TFLOPs"] = work / sec / 1e12
        else:
            row["GBps"] = work / sec / 1e9
            row["pct_copy"] = 100.0 * row["GBps"] / ceilings["copy_GBps"]
        if best_sdpa:  # per round: the fastest SDPA backend's time / this one's; the median over rounds
            row["speedup_vs_best_sdpa"] = paired_ratio(best_sdpa, row)
        rows.append(row)
        print(f"{mode:14s} B={b:<2d} H={h} Sq={sq:<5d} Skv={skv:<5d} D={d:<3d} {name:18s} "
              f"{row['median_ms']:8.4f} ms  " + (f"{row['TFLOPs']:7.1f} TFLOP/s" if causal else
                                                 f"{row['GBps']:7.0f} GB/s ({row['pct_copy']:.0f}% of copy)")
              + (f"  x best SDPA {row['speedup_vs_best_sdpa']:.3f}" if sdpa else ""), flush=True)
    del q, k, v, ref
    torch.cuda.empty_cache()
    return rows


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _first_line(exc: Exception) -> str:
    """The first line of an exception's message (at most 120 characters), for a row's note."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_semantics(ext) -> None:
    """Masked, offset and strided cases against the fp32 reference of the op, before any timing."""
    from fuseinfer.ops.attention import attention_ref

    torch.manual_seed(1)
    sm90 = (True, False) if ext.attention_prefill_kernel() in ("wgmma", "wgmma_fp8") else (True,)
    for d, enabled in ((d, enabled) for d in (64, 128) for enabled in sm90):
        for sq, skv, q_start in ((113, 113, None), (1, 4096, None), (4, 1024, 500), (16, 700, None)):
            b, h = 3, 4
            qkv = torch.randn(b, sq, 3, h, d, device="cuda", dtype=DTYPE)
            q = qkv[:, :, 0].transpose(1, 2)  # strided view, as the patched model passes it
            k = torch.randn(b, h, skv, d, device="cuda", dtype=DTYPE)
            v = torch.randn(b, h, skv, d, device="cuda", dtype=DTYPE)
            pads = torch.tensor([0, 7, skv], device="cuda")  # row 2 fully padded: output must be exactly 0
            key_mask = torch.arange(skv, device="cuda")[None] >= pads[:, None]
            qs = None if q_start is None else torch.full((b,), q_start, device="cuda", dtype=torch.int32)
            with knobs.override(ATTN_SM90="1" if enabled else "0", ATTN_FP8="0"):
                out = ext.attention(q, k, v, key_mask, qs, d ** -0.5)
            ref = attention_ref(q.float(), k.float(), v.float(), key_mask, qs, d ** -0.5)
            err = (out.float() - ref).abs().max().item()
            assert err <= MAX_ERR, f"semantics check d={d} sq={sq} skv={skv}: max abs error {err:.3g}"
            assert out[2].abs().max().item() == 0, "fully masked row must give exactly 0"
    print("semantics check passed (strided q, key_mask, q_start, fully masked row)")


def check_flash(ext) -> str | None:
    """None when flash-attn-4 imports and fuseinfer's mapping onto it (ops/flash_attention.py) matches the op's fp32
    reference on masked / offset / decode cases, each through the package (not the fallback); else why not."""
    from fuseinfer.ops.attention import attention_ref

    fa, why = fa_op.load_flash_attn()
    if fa is None:
        return f"flash-attn-4 does not import: {why}"
    torch.manual_seed(2)
    try:
        for d in (64, 128):
            for sq, skv, q_start, padded in ((113, 113, None, False), (113, 113, None, True), (1, 4096, None, False),
                                             (1, 4096, None, True), (4, 1024, 500, False), (4, 1024, 500, True),
                                             (16, 700, None, True)):
                b, h = 3, 4
                qkv = torch.randn(b, sq, 3, h, d, device="cuda", dtype=DTYPE)
                q = qkv[:, :, 0].transpose(1, 2)  # strided view, as the patched model passes it
                k = torch.randn(b, h, skv, d, device="cuda", dtype=DTYPE)
                v = torch.randn(b, h, skv, d, device="cuda", dtype=DTYPE)
                key_mask = None
                if padded:  # row 2 fully padded: output must be exactly 0
                    key_mask = torch.arange(skv, device="cuda")[None] >= torch.tensor([0, 7, skv], device="cuda")[:, None]
                qs = None if q_start is None else torch.full((b,), q_start, device="cuda", dtype=torch.int32)
                kind, info = fa_op.plan(q, k, key_mask, qs)
                case = f"d={d} sq={sq} skv={skv} q_start={q_start} padded={padded}"
                if kind is None:
                    return f"{case}: the mapping did not take flash-attn-4 ({info})"
                out = fa_op.flash_attention_cuda(q, k, v, key_mask, qs, d ** -0.5)
                ref = attention_ref(q.float(), k.float(), v.float(), key_mask, qs, d ** -0.5)
                err = (out.float() - ref).abs().nan_to_num(float("inf")).max().item()
                if not err <= MAX_ERR:
                    return f"{case} ({kind}): max abs error {err:.3g} > {MAX_ERR}"
                if padded and out[2].abs().max().item() != 0:
                    return f"{case} ({kind}): a fully masked row is not exactly 0"
    except Exception as exc:  # the package fails to compile or run here: say exactly what
        return f"flash-attn-4 {fa_op.package_version()} failed: {type(exc).__name__}: {_first_line(exc)}"
    print("flash-attn-4 mapping check passed (dense, seqused_k, left-padded runs, fully masked row)")
    return None


def auto_table(rows: list[dict]) -> dict:
    """(phase, D) -> "flash_attn" for the classes where flash_attn's median beat fuseinfer's in every row."""
    wins: dict[tuple, list[bool]] = {}
    by_key = {(r["mode"], r["B"], r["H"], r["Sq"], r["Skv"], r["D"], r["impl"]): r for r in rows if "median_ms" in r}
    for (mode, b, h, sq, skv, d, impl), r in by_key.items():
        if impl != "fuseinfer":
            continue
        fa = by_key.get((mode, b, h, sq, skv, d, "flash_attn"))
        phase = "prefill" if mode.startswith("prefill") else "decode"
        wins.setdefault((phase, d), []).append(fa is not None and fa["median_ms"] < r["median_ms"])
    return {f"{phase},{d}": "flash_attn" for (phase, d), won in sorted(wins.items()) if won and all(won)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few configs, short timing")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds over all implementations")
    parser.add_argument("--no-flash-attn", action="store_true", help="leave out the flash-attn-4 column")
    parser.add_argument("--prefill-only", action="store_true",
                        help="prefill rows only, with batch-1 rows of OPT-1.3b's and OPT-6.7b's heads (results file "
                             "attention_prefill)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    import fuseinfer
    if not fuseinfer.cuda_extension_available():
        raise SystemExit(f"bench_attention: the CUDA extension is unavailable: {fuseinfer.extension_status()}")
    from fuseinfer.core.extension import extension
    ext = extension()

    timing = dict(warmup_ms=10, rep_ms=40) if args.quick else dict(warmup_ms=25, rep_ms=100)
    if args.quick:
        prefill = [(4, 32, 2048, 64), (4, 16, 2048, 128)]
        prefill_padded = [(4, 32, 2048, 64), (4, 16, 2048, 128)]
        decode = [(8, 32, ctx, 64) for ctx in (512, 4096)] + [(8, 16, 4096, 128)]
        decode_padded = [(8, 32, 4096, 64)]
    else:
        prefill = [(b, 32 if d == 64 else 16, s, d) for d in (64, 128)
                   for b, s in ((8, 512), (4, 2048), (8, 2048), (4, 4096), (1, 8192))]
        prefill_padded = [(b, 32 if d == 64 else 16, s, d) for d in (64, 128) for b, s in ((8, 512), (4, 2048),
                                                                                           (4, 8192))]
        decode = [(b, 32 if d == 64 else 16, ctx, d) for d in (64, 128) for b in (1, 8, 32)
                  for ctx in (512, 2048, 4096, 8192)]
        decode_padded = [(8, 32 if d == 64 else 16, ctx, d) for d in (64, 128) for ctx in (512, 8192)]

    if args.prefill_only:
        prefill = [(1, 32, 2048, 64), (1, 32, 2048, 128)] + prefill
        decode, decode_padded = [], []
    check_semantics(ext)
    flash_skip = "--no-flash-attn" if args.no_flash_attn else check_flash(ext)
    if flash_skip:
        print(f"flash_attn column skipped: {flash_skip}", flush=True)
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_GBps']:.0f} GB/s, cuBLAS fp16 {ceilings['matmul_fp16_TFLOPs']:.0f} TFLOP/s")
    rows = []
    flash = flash_skip is None
    for mode, configs in (("prefill", prefill), ("prefill_padded", prefill_padded)):
        for b, h, s, d in configs:
            rows += run_config(mode, b, h, s, s, d, ext, ceilings, timing, args.rounds, flash)
    for mode, configs in (("decode", decode), ("decode_padded", decode_padded)):
        for b, h, ctx, d in configs:
            rows += run_config(mode, b, h, 1, ctx, d, ext, ceilings, timing, args.rounds, flash)
    measured = auto_table(rows) if flash else {}
    print("AUTO_TABLE rows measured (flash_attn faster than fuseinfer in every row of the class): "
          + (", ".join(f"({k.split(',')[0]!r}, {k.split(',')[1]}): 'flash_attn'" for k in measured) or "none"))

    settings = dict(quick=args.quick, prefill_only=args.prefill_only, dtype=str(DTYPE), causal_prefill=True, decode_sq=1, **timing, rounds=args.rounds,
                    timing="each implementation once per round (do_bench median); median_ms = median over rounds, "
                           "min/max over rounds; speedup_vs_best_sdpa = median over rounds of the round's fastest "
                           "SDPA time / this one's",
                    prefill_kernel=ext.attention_prefill_kernel(),
                    flash_attn=dict(version=fa_op.package_version(), skipped=flash_skip,
                                    cutlass_dsl=_version("nvidia-cutlass-dsl")),
                    auto_table_measured=measured,
                    padded="row b of B left-padded by b*S/(2B); TFLOP/s and GB/s count real tokens only",
                    flops="prefill: 4*B*H*S^2*D/2 (causal)", bytes="decode: K+V read + q read + out written")
    columns = ["mode", "B", "H", "Sq", "Skv", "D", "impl", "median_ms", "min_ms", "max_ms", "TFLOPs", "GBps",
               "pct_copy", "speedup_vs_best_sdpa", "max_abs_err", "note"]
    path = write_results("attention_prefill" if args.prefill_only else "attention", settings, ceilings, rows, columns)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
