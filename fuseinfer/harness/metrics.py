"""Derived figures: throughput, prefill FLOP rate, decode memory bandwidth and speedups, with their formulas.

B = batch size, P = prompt length, G = decode steps timed, L = layers, H = hidden size, e = bytes per element.
"""
from __future__ import annotations

from fuseinfer.harness.models import ModelStats


def prefill_flops(stats: ModelStats, batch: int, prompt_len: int) -> float:
    """FLOPs of one prefill:

    2 * matmul_params * B * P            every prompt token through every decoder Linear (multiply + add)
    + 2 * lm_head_params * B             logits for the last prompt token only (logits_to_keep=1)
    + 2 * 2 * L * B * P^2 * H / 2        Q K^T and P V, 2 * P^2 * H each per layer and sequence, halved (causal)
    """
    linear = 2 * stats.matmul_params * batch * prompt_len
    lm_head = 2 * stats.lm_head_params * batch
    attention = 2 * 2 * stats.layers * batch * prompt_len**2 * stats.hidden / 2
    return linear + lm_head + attention


def decode_bytes_per_step(stats: ModelStats, batch: int, prompt_len: int, gen_len: int) -> float:
    """Bytes one decode step must read from memory, at least (activations and the one position row ignored):

    weight_bytes_per_token               every weight once (all parameters but tables read a row at a time)
    + 2 * L * B * ctx * W * e            K and V (W = key/value heads x head dim per position) of every layer and
                                         batch row for the ctx positions the step attends: step i of G (from 0, after a prefill of P)
                                         attends P + i + 1, so ctx = P + (G + 1) / 2 on average over the G steps
    """
    mean_context = prompt_len + (gen_len + 1) / 2
    kv = 2 * stats.layers * batch * mean_context * (stats.kv_width or stats.hidden) * stats.element_size
    return stats.weight_bytes_per_token + kv


def derive(row: dict, stats: ModelStats, batch: int, prompt_len: int, gen_len: int,
           copy_gbps: float | None, eager: dict | None) -> dict:
    """The derived figures of one backend's row (None where an input is missing)."""
    prefill = (row.get("prefill_ms") or {}).get("median")
    decode = (row.get("decode_ms_per_token") or {}).get("median")
    out = {"tokens_per_s": None, "prefill_tflops": None, "decode_gbps": None, "decode_bw_fraction": None,
           "speedup_prefill": None, "speedup_decode": None}
    if prefill:
        out["prefill_tflops"] = prefill_flops(stats, batch, prompt_len) / (prefill * 1e-3) / 1e12
    if decode:
        out["tokens_per_s"] = batch * 1000 / decode  # tokens/s = B * 1000 / (ms per step)
        out["decode_gbps"] = decode_bytes_per_step(stats, batch, prompt_len, gen_len) / (decode * 1e-3) / 1e9
        if copy_gbps:
            out["decode_bw_fraction"] = out["decode_gbps"] / copy_gbps  # vs measured copy (read + write) GB/s
    eager_prefill = ((eager or {}).get("prefill_ms") or {}).get("median")
    eager_decode = ((eager or {}).get("decode_ms_per_token") or {}).get("median")
    if prefill and eager_prefill:
        out["speedup_prefill"] = eager_prefill / prefill  # eager median time / this backend's median time
    if decode and eager_decode:
        out["speedup_decode"] = eager_decode / decode
    return out
