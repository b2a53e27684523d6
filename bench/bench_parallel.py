"""Models larger than one GPU: tensor parallel over NCCL and accelerate's device_map, on 2 GPUs.

    torchrun --nproc-per-node 2 bench/bench_parallel.py tp [PART ...]   # TP=2 parts: correctness 66b 30b 66b_int8
    python bench/bench_parallel.py single [PART ...]                   # one process: 30b dm_logits dm_66b
    python bench/bench_parallel.py report                              # parallel.{json,md} from the parts' files
    ... --small                                                        # CPU smoke run: gloo, small configs

Each part writes ``parallel_<group>_<part>.json`` under $FUSEINFER_BENCH_DIR as soon as it is done (rank 0), so a
failure or a timeout later keeps what was measured; a TP part that raises writes its error
(``parallel_<group>_<part>.error.json``) and ends the process with exit 1 (torchrun then stops the other rank: no
rank waits on a collective its peer will never join). The stage script re-runs missing TP parts eagerly
(FUSEINFER_TP_GRAPHS=0) and the report says which run each figure came from (``graphs``).

Random weights throughout (``fuseinfer.parallel.random_init``: every parameter drawn on its GPU from a generator
seeded by its name, so TP shards, single-GPU and device_map models hold the same values). Timing: wall clock between
synchronizations of the GPUs involved (one decode step or one prefill per sample: ~10 us of sync on 10-60 ms),
warm-up excluded, medians with p10-p90 (``fuseinfer.harness.timing.summarize``); "grouped" decode: one replay of the
session's 16-step graph, per token (the runtime's own way of running ``generate``). Derived
figures (formulas here): weight-read floor = bytes of weights one decode step reads on a GPU (all parameters but
the position table; the tied LM head once) / device-to-device copy bandwidth measured in the same run
(``copy_bandwidth_gbps``, read + written bytes / time); for device_map the floor is sequential: all weights / the
copy bandwidth (one GPU works at a time). fp16 rule: |ours - ref_fp32| <= 2 |torch_fp16 - ref_fp32| (max abs over
the logits) + 1e-3.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)  # (before torch makes any NCCL communicator)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fuseinfer  # noqa: E402
from fuseinfer.models.opt.configs import OPT_CONFIGS  # noqa: E402
from fuseinfer.harness.timing import copy_bandwidth_gbps, summarize  # noqa: E402
from fuseinfer.harness.materialize import (device_map_lookup, materialize, meta_model, random_init,  # noqa: E402
                                            random_model)

RESULTS_DIR = Path(os.environ.get("FUSEINFER_BENCH_DIR", Path(__file__).resolve().parent / "results"))
SEED = 0
CTX, GEN, PREFILL = 512, 48, 2048  # decode context, timed decode steps, prefill length
DM_STEPS = (12, 24)  # device_map OPT-66b: unpatched eager steps, patched steps (each ~50-70 ms: both GPUs in turn)
RULE_ATOL = 1e-3
# --small: a CPU smoke run of every code path (gloo, tiny configs, fp32); set by main
SMALL = False
_SMALL_SHAPES = {"opt-1.3b": (128, 2, 256, 4), "opt-30b": (128, 3, 256, 4), "opt-66b": (256, 2, 512, 4)}
TP_PARTS = ("correctness", "66b", "30b", "66b_int8")
SINGLE_PARTS = ("30b", "dm_logits", "dm_66b")


def dtype() -> torch.dtype:
    return torch.float32 if SMALL else torch.float16


def device(index: int = 0) -> torch.device:
    return torch.device("cpu") if SMALL else torch.device("cuda", index)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sync_all() -> None:
    if not SMALL:
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.empty(0, device=dev)  # (the allocator of a device not used yet refuses: "Invalid device argument")
        torch.cuda.reset_peak_memory_stats(dev)


def floor_ms(nbytes: int, gbps) -> float | None:
    """bytes / copy bandwidth (GB/s, read + written) in ms; None without a measured bandwidth (CPU)."""
    return nbytes / 1e9 / gbps * 1e3 if gbps else None


def opt_config(short: str):
    from transformers import OPTConfig

    kwargs = dict(OPT_CONFIGS[f"facebook/{short}"])
    if SMALL:
        hidden, layers, ffn, heads = _SMALL_SHAPES[short]
        kwargs.update(hidden_size=hidden, num_hidden_layers=layers, ffn_dim=ffn, num_attention_heads=heads,
                      word_embed_proj_dim=hidden, vocab_size=512, max_position_embeddings=2048)
    return OPTConfig(**kwargs)


def log(*args):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(*args, flush=True)


def free(*models):
    for m in models:
        if m is not None:
            fuseinfer.runtime.release(m)
    del models
    gc.collect()
    if not SMALL:
        torch.cuda.empty_cache()


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads on this GPU / in this model: every parameter once (tied once) but the
    position table (one row is read)."""
    pos = model.model.decoder.embed_positions.weight
    seen, total = set(), 0
    quant = [b for n, b in model.named_buffers() if n.endswith((".qweight", ".scale"))]  # int8 weights, scales
    for p in [*model.parameters(), *quant]:  # (by storage: accelerate's hooks re-wrap tied weights in new objects)
        key = (p.device, p.data_ptr())
        if key not in seen and p is not pos and not p.is_meta:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def fp16_rule(ours: torch.Tensor, torch16: torch.Tensor, ref32: torch.Tensor) -> dict:
    err = (ours.float() - ref32).abs().max().item()
    base = (torch16.float() - ref32).abs().max().item()
    return {"ours_max_err": err, "torch_fp16_max_err": base, "bound": 2 * base + RULE_ATOL,
            "pass": bool(err <= 2 * base + RULE_ATOL)}


def prompt(length: int, vocab: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(SEED))


def events_ms(fn, repeats: int, sync) -> list[float]:  # (wall clock: work may span several GPUs)
    """Per-call ms of ``fn`` (wall clock between synchronized ends: right for work on several GPUs)."""
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def fuseinfer_decode(model, ids: torch.Tensor, steps: int, sync) -> dict:
    """Prefill ids through the fast-decode session, then ``steps`` single-step decodes timed one by one; also
    the same tokens as one run() (graph groups), ms per token."""
    from fuseinfer.runtime.decode import Sampling, decode_forward, session_for

    forward, why = decode_forward(model)
    if forward is None:
        return {"error": why}
    dev = next(model.parameters()).device
    b, p = ids.shape
    session = session_for(model, forward, b, p + steps + 1, Sampling(), steps + 1, torch.empty(0, dtype=torch.long),
                          pad=1)
    ids, mask = ids.to(dev), torch.ones_like(ids, device=dev)
    session.begin(ids, mask)
    for _ in range(4):  # warm-up
        session.advance()
    session.begin(ids, mask)
    step_ms = events_ms(session.advance, steps, sync)
    tokens = session.out[:b, :8].tolist()
    group = max(session.graphs, default=min(16, steps // 4))  # steps per replay of the longer graph
    session.begin(ids, mask)
    group_ms = events_ms(lambda: session.advance(group), max(1, steps // group - 1), sync)
    return {"decode_ms_per_token": summarize(step_ms), "grouped_ms_per_token": min(group_ms) / group,
            "group_steps": group, "path": session.path, "graphs": bool(session.graphs), "tokens": tokens}


def hf_decode(model, ids: torch.Tensor, steps: int, sync) -> dict:
    """transformers' eager decode (DynamicCache): prefill, then ``steps`` single-token forwards timed one by one."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = ids.to(dev)
    cache = DynamicCache(config=model.config)
    tok = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    state = {"tok": tok.to(dev)}

    def step():
        out = model(input_ids=state["tok"], past_key_values=cache, use_cache=True)
        state["tok"] = out.logits[:, -1:].argmax(-1).to(dev)

    for _ in range(2):
        step()
    return {"decode_ms_per_token": summarize(events_ms(step, steps, sync))}


def prefill_ms(model, ids: torch.Tensor, sync, repeats: int = 3) -> dict:
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    fn = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    fn()
    return summarize(events_ms(fn, repeats, sync))


def mem_phase(dev: torch.device, phases: dict, name: str) -> None:
    """Record the memory of the phase that just ended -- allocated now and the peak since the last phase (both
    GiB, torch.cuda.memory_allocated / max_memory_allocated) -- then reset the peak, so each phase's peak is its
    own: which phase (build, patch / shard, decode graphs, prefill) sets the run's peak (measured: 98.9 GiB per GPU
    at OPT-66b TP=2 against 61.6 GiB of weights). None on CPU."""
    if dev.type != "cuda":
        phases[name] = None
        return
    sync(dev)
    phases[name] = {"allocated_gib": torch.cuda.memory_allocated(dev) / 2**30,
                    "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30}
    torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


# ---- tensor parallel (torchrun --nproc-per-node 2) ------------------------------------------------------------

def tp_model(short: str, config=None):
    """OPT ``short`` built on meta and sharded over the ranks, each rank drawing its shard on its device."""
    from fuseinfer.parallel import tensor_parallel

    t0 = time.perf_counter()
    model = meta_model(opt_config(short), dtype())
    report = tensor_parallel(model, init=random_init(SEED), config=config)
    sync(next(model.parameters()).device)
    return model, report, time.perf_counter() - t0


def tp_speed(short: str, prefill: bool, int8: bool = False) -> dict:
    """TP=2 decode (batch 1, context CTX) against the per-GPU weight-read floor; prefill 1 x PREFILL; peaks."""
    import torch.distributed as dist

    dev = _rank_device()
    reset_peak(dev)
    config = fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly()) if int8 else None
    phases: dict = {}
    mem_phase(dev, phases, "start")
    model, _, build_s = tp_model(short, config)
    mem_phase(dev, phases, "build + shard + patch (tensor_parallel)")
    copy = copy_bandwidth_gbps(dev)
    mem_phase(dev, phases, "copy-bandwidth probe")
    wbytes = weight_bytes(model)
    cfg = model.config
    row = {"model": short + (" int8 weight-only" if int8 else ""), "tp": dist.get_world_size(), "build_s": build_s,
           "weight_gb_per_gpu": wbytes / 1e9, "copy_gbps": copy, "floor_ms": floor_ms(wbytes, copy)}
    row.update(fuseinfer_decode(model, prompt(CTX, cfg.vocab_size), GEN, lambda: sync(dev)))
    mem_phase(dev, phases, "decode (session, KV cache, graph capture + replays)")
    if prefill:
        row["prefill_ms"] = prefill_ms(model, prompt(PREFILL if not SMALL else 64, cfg.vocab_size), lambda: sync(dev))
        mem_phase(dev, phases, f"prefill 1x{PREFILL if not SMALL else 64}")
    peaks = [p["peak_gib"] for p in phases.values() if p]
    row["peak_gib_per_gpu"] = _gather(max(peaks) if peaks else peak_gib(dev))
    row["memory_phases_per_gpu"] = _gather(phases)
    row["ranks_agree"] = all(t == row.get("tokens") for t in _gather(row.get("tokens")))
    if "decode_ms_per_token" in row and row["floor_ms"]:
        row["x_floor"] = row["decode_ms_per_token"]["median"] / row["floor_ms"]
    free(model)
    del model
    free()
    return row


def _rank_device() -> torch.device:
    return device(torch.cuda.current_device()) if not SMALL else device()


def _gather(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def tp_correctness() -> dict:
    """Random OPT-1.3b TP=2 logits against the one-GPU fp32 reference (fp16 rule), and the tiny trained model's
    greedy tokens TP=2 against one-GPU fuseinfer (rank 0 computes the one-GPU sides while rank 1 waits)."""
    import torch.distributed as dist

    rank, dev = dist.get_rank(), _rank_device()
    results = {}
    model, _, _ = tp_model("opt-1.3b")
    ids = prompt(CTX, model.config.vocab_size).to(dev)
    with torch.no_grad():
        tp_logits = model(input_ids=ids).logits.float()
    free(model)
    del model
    free()
    if rank == 0:
        with torch.no_grad():
            ref = random_model(opt_config("opt-1.3b"), torch.float32, dev, SEED)
            ref32 = ref(input_ids=ids).logits.float()
            free(ref)
            del ref
            half = random_model(opt_config("opt-1.3b"), dtype(), dev, SEED)
            torch16 = half(input_ids=ids).logits.float()
            free(half)
            del half
        results["tp_logits_opt-1.3b"] = {"model": f"random opt-1.3b {dtype()}", "prompt": CTX,
                                         **fp16_rule(tp_logits, torch16, ref32)}
        log(json.dumps(results["tp_logits_opt-1.3b"]))
        del ref32, torch16
    del tp_logits
    free()
    dist.barrier()
    from transformers import AutoModelForCausalLM

    from fuseinfer.parallel import tensor_parallel

    path = Path(os.environ.get("FUSEINFER_SHARED", "shared")) / "models" / "opt-wt2-tiny"
    if not (path / "config.json").exists():
        results["tp_tokens_tiny"] = {"error": f"no tiny model at {path}"}
        return results
    tiny = AutoModelForCausalLM.from_pretrained(path, dtype=dtype()).eval()
    ids = prompt(32, tiny.config.vocab_size, batch=2)
    tensor_parallel(tiny)
    tp_tokens = fuseinfer.generate(tiny, ids.to(dev), max_new_tokens=48)
    hf_tokens = tiny.generate(ids.to(dev), max_new_tokens=48, do_sample=False)
    gathered = _gather(tp_tokens.cpu().tolist())
    path_tp = next(iter(tiny._fuseinfer_sessions.values())).path
    free(tiny)
    del tiny
    if rank == 0:
        one = AutoModelForCausalLM.from_pretrained(path, dtype=dtype()).eval().to(dev)
        fuseinfer.patch(one)
        want = fuseinfer.generate(one, ids.to(dev), max_new_tokens=48)
        same_shape = want.shape == tp_tokens.shape
        results["tp_tokens_tiny"] = {"model": f"opt-wt2-tiny {dtype()}", "new_tokens": 48, "batch": 2,
                                     "equal_single_gpu": torch.equal(tp_tokens, want),
                                     "model_generate_equal": torch.equal(hf_tokens, tp_tokens),
                                     "ranks_agree": all(g == gathered[0] for g in gathered),
                                     "match_fraction": (tp_tokens == want).float().mean().item() if same_shape
                                     else 0.0, "tp_path": path_tp}
        log(json.dumps(results["tp_tokens_tiny"]))
        free(one)
        del one
    dist.barrier()
    return results


def main_tp(parts: list[str]) -> int:
    """Each part in turn; rank 0 writes its file when done. A part that raises on any rank ends the process (exit
    1) after writing its error: torchrun then stops the other rank, so none waits on a collective forever."""
    from fuseinfer.parallel import init_distributed

    # a hang ends in 2 minutes with NCCL's error, before the stage's timeout
    init_distributed("gloo" if SMALL else None, timeout_s=120)
    import torch.distributed as dist

    rank = dist.get_rank()
    runs = {"correctness": tp_correctness,
            "66b": lambda: {"tp_opt-66b": tp_speed("opt-66b", prefill=True)},
            "30b": lambda: {"tp_opt-30b": tp_speed("opt-30b", prefill=False)},
            "66b_int8": lambda: {"tp_opt-66b_int8": tp_speed("opt-66b", prefill=False, int8=True)}}
    for part in parts:
        log(f"== tp: {part}")
        t0 = time.perf_counter()
        try:
            results = runs[part]()
        except BaseException as exc:  # noqa: BLE001 (also KeyboardInterrupt from torchrun's SIGTERM)
            traceback.print_exc()
            write_part(f"tp_{part}", {"error": f"rank {rank}: {type(exc).__name__}: {exc}"[:2000]}, error=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        log(f"== tp: {part} done in {time.perf_counter() - t0:.1f} s")
        if rank == 0:
            write_part(f"tp_{part}", results)
        dist.barrier()
    dist.destroy_process_group()
    return 0


# ---- one process: OPT-30b on one GPU, device_map over 2 GPUs ----------------------------------------------------

def single_30b() -> dict:
    dev = device(0)
    reset_peak(dev)
    phases: dict = {}
    mem_phase(dev, phases, "start")
    t0 = time.perf_counter()
    model = random_model(opt_config("opt-30b"), dtype(), dev, SEED)
    sync(dev)
    build_s = time.perf_counter() - t0
    mem_phase(dev, phases, "build")
    fuseinfer.patch(model)
    mem_phase(dev, phases, "patch")
    wbytes, copy = weight_bytes(model), copy_bandwidth_gbps(dev)
    row = {"model": "opt-30b", "gpus": 1, "build_s": build_s, "weight_gb_per_gpu": wbytes / 1e9, "copy_gbps": copy,
           "floor_ms": floor_ms(wbytes, copy)}
    row.update(fuseinfer_decode(model, prompt(CTX, model.config.vocab_size), GEN, lambda: sync(dev)))
    mem_phase(dev, phases, "decode (session, KV cache, graph capture + replays)")
    peaks = [p["peak_gib"] for p in phases.values() if p]
    row["peak_gib_per_gpu"] = [max(peaks) if peaks else None]
    row["memory_phases_per_gpu"] = [phases]
    if "decode_ms_per_token" in row and row["floor_ms"]:
        row["x_floor"] = row["decode_ms_per_token"]["median"] / row["floor_ms"]
    log(json.dumps(row))
    fuseinfer.unpatch(model)
    free(model)
    del model
    free()
    return {"single_opt-30b": row}


def dispatched(short: str, device_map: dict | str):
    """A random model placed by accelerate over the GPUs: each parameter drawn on its device, then
    dispatch_model's hooks (as from_pretrained(device_map=...) installs them)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    model = meta_model(opt_config(short), dtype())
    if device_map == "auto" and SMALL:  # (no GPUs to balance over)
        device_map = split_map(model.config.num_hidden_layers)
    if device_map == "auto":  # transformers' device_map="auto": balanced over the visible GPUs
        no_split = model._no_split_modules
        memory = get_balanced_memory(model, dtype=dtype(), no_split_module_classes=no_split)
        memory = {k: v for k, v in memory.items() if not isinstance(k, str)}  # GPUs only: never offload
        device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split,
                                           dtype=dtype())
    if any(d in ("cpu", "disk") for d in device_map.values()) and not SMALL:
        raise RuntimeError(f"device_map offloads ({set(device_map.values())}): not the measurement asked for")
    materialize(model, device_map_lookup(device_map), random_init(SEED))
    if SMALL:
        return dispatch_model(model, device_map, main_device="cpu"), device_map
    return dispatch_model(model, device_map), device_map


def split_map(layers: int) -> dict:
    """OPT over 2 GPUs: embeddings, first half of the layers and the LM head (tied to the embeddings) on 0."""
    half = layers // 2
    d0, d1 = ("cpu", "cpu") if SMALL else (0, 1)
    m = {"model.decoder.embed_tokens": d0, "model.decoder.embed_positions": d0, "lm_head": d0,
         "model.decoder.final_layer_norm": d1}
    m.update({f"model.decoder.layers.{i}": d0 if i < half else d1 for i in range(layers)})
    return m


def device_map_logits() -> dict:
    """OPT-1.3b split over 2 GPUs: patched vs unpatched logits, both against a one-GPU fp32 reference."""
    cfg = opt_config("opt-1.3b")
    dev = device(0)
    ids = prompt(CTX, cfg.vocab_size).to(dev)
    with torch.no_grad():
        ref = random_model(cfg, torch.float32, dev, SEED)
        ref32 = ref(input_ids=ids).logits.float()
        free(ref)
        del ref
        model, _ = dispatched("opt-1.3b", split_map(cfg.num_hidden_layers))
        unpatched = model(input_ids=ids).logits.float()
        report = fuseinfer.patch(model)
        patched = model(input_ids=ids).logits.float()
        tokens = fuseinfer.generate(model, ids[:, :64], max_new_tokens=16)
    half = cfg.num_hidden_layers // 2
    row = {"model": f"random opt-1.3b {dtype()}, layers 0-{half - 1} on cuda:0, {half}-{cfg.num_hidden_layers - 1} "
                    "on cuda:1", **fp16_rule(patched, unpatched, ref32),
           "patched_vs_unpatched_max_diff": (patched - unpatched).abs().max().item(),
           "swapped": len(report.swaps), "skipped": report.skipped, "placement": sorted(set(report.placement.values())),
           "generate_ok": tuple(tokens.shape) == (1, 80),
           "path": next(iter(model._fuseinfer_sessions.values())).path}
    log(json.dumps(row, default=str))
    fuseinfer.unpatch(model)
    free(model)
    del model, ref32, unpatched, patched
    free()
    return {"device_map_logits_opt-1.3b": row}


def device_map_66b() -> dict:
    """OPT-66b with device_map="auto" over the 2 GPUs: unpatched eager decode, then patched fast decode."""
    for i in range(torch.cuda.device_count() if not SMALL else 0):
        torch.cuda.reset_peak_memory_stats(i)
    t0 = time.perf_counter()
    model, device_map = dispatched("opt-66b", "auto")
    sync_all()
    build_s = time.perf_counter() - t0
    cfg = model.config
    wbytes, copy = weight_bytes(model), copy_bandwidth_gbps(device(0))
    row = {"model": "opt-66b", "device_map": "auto", "gpus": sorted({str(d) for d in device_map.values()}),
           "build_s": build_s, "weight_gb": wbytes / 1e9, "copy_gbps": copy,
           "sequential_floor_ms": floor_ms(wbytes, copy)}
    ids = prompt(CTX, cfg.vocab_size)
    with torch.no_grad():
        row["unpatched_eager"] = hf_decode(model, ids, DM_STEPS[0], sync_all)
        report = fuseinfer.patch(model)
        row["swapped"], row["skipped"] = len(report.swaps), report.skipped
        row["patched"] = fuseinfer_decode(model, ids, DM_STEPS[1], sync_all)
    if "decode_ms_per_token" in row["patched"] and row["sequential_floor_ms"]:
        row["x_floor"] = row["patched"]["decode_ms_per_token"]["median"] / row["sequential_floor_ms"]
    row["peak_gib_per_gpu"] = [peak_gib(device(i)) for i in range(torch.cuda.device_count() if not SMALL else 0)]
    log(json.dumps(row, default=str))
    fuseinfer.unpatch(model)
    free(model)
    del model
    free()
    return {"device_map_opt-66b": row}


def main_single(parts: list[str]) -> int:
    """Each part in turn, its file written when done; a part that fails (OOM, say) writes its error and the next
    part still runs (one process, no collectives)."""
    runs = {"30b": single_30b, "dm_logits": device_map_logits, "dm_66b": device_map_66b}
    failed = 0
    for part in parts:
        log(f"== single: {part}")
        t0 = time.perf_counter()
        try:
            write_part(f"single_{part}", runs[part]())
            log(f"== single: {part} done in {time.perf_counter() - t0:.1f} s")
        except Exception as exc:
            traceback.print_exc()
            write_part(f"single_{part}", {"error": f"{type(exc).__name__}: {exc}"[:2000]}, error=True)
            failed = 1
            free()
    return failed


# ---- results -----------------------------------------------------------------------------------------------------

def write_part(name: str, results: dict, error: bool = False) -> None:
    """parallel_<name>.json (or parallel_<name>.error.json) with the environment and settings."""
    from fuseinfer.harness.environment import environment

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    env = environment(device(0))
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not SMALL else []
    env["tp_graphs_env"] = os.environ.get("FUSEINFER_TP_GRAPHS", "")
    out = {"part": name, "environment": env, "small": SMALL,
           "settings": {"ctx": CTX, "gen": GEN, "prefill": PREFILL, "seed": SEED, "dm_steps": DM_STEPS},
           "results": results}
    suffix = ".error.json" if error else ".json"
    (RESULTS_DIR / f"parallel_{name}{suffix}").write_text(json.dumps(out, indent=1, default=str))


def _ms(stat) -> str:
    return f"{stat['median']:.2f} [{stat['p10']:.2f}-{stat['p90']:.2f}]" if isinstance(stat, dict) else "-"


def _f(x, fmt=".1f") -> str:
    return "-" if x is None else format(x, fmt)


def missing(group: str, parts) -> list[str]:
    """The parts of ``group`` without a result file (what a re-run should do)."""
    return [p for p in parts if not (RESULTS_DIR / f"parallel_{group}_{p}.json").exists()]


def main_report() -> int:
    parts = {f.name[len("parallel_"):-len(".json")]: json.loads(f.read_text())
             for f in sorted(RESULTS_DIR.glob("parallel_*.json"))
             if not f.name.endswith(".error.json") and f.name != "parallel.json"}
    errors = {f.name[len("parallel_"):-len(".error.json")]: json.loads(f.read_text())
              for f in sorted(RESULTS_DIR.glob("parallel_*.error.json"))}
    res = {k: v for part in parts.values() for k, v in part["results"].items()}
    env = next(iter(parts.values()))["environment"] if parts else {}
    ok = True
    lines = ["# Models larger than one GPU (bench/bench_parallel.py)", "",
             f"GPUs: {env.get('gpus')}; driver {env.get('driver')}; torch {env.get('torch')}; "
             f"transformers {env.get('transformers')}; random weights (seeded per parameter name); decode batch 1 at "
             f"context {CTX} ({GEN} timed steps); ms medians [p10-p90]. Floors: weight bytes a decode step reads "
             "per GPU / the device-to-device copy bandwidth measured in this run on that GPU.", "",
             "| what | figure | target / note |", "|---|---|---|"]
    r = res.get("tp_logits_opt-1.3b")
    if r:
        ok &= r["pass"]
        lines.append(f"| TP=2 logits, random OPT-1.3b fp16 vs one-GPU fp32 | max err {r['ours_max_err']:.4f} "
                     f"(PyTorch fp16 {r['torch_fp16_max_err']:.4f}) | <= 2x PyTorch fp16 + 1e-3: "
                     f"{'pass' if r['pass'] else 'FAIL'} |")
    r = res.get("tp_tokens_tiny")
    if r and "error" not in r:
        ok &= r["equal_single_gpu"] and r["ranks_agree"]
        lines.append(f"| TP=2 greedy tokens, tiny model (2 x 48) | equal to one-GPU fuseinfer: {r['equal_single_gpu']} "
                     f"(match {r['match_fraction']:.3f}); model.generate equal: {r['model_generate_equal']}; ranks "
                     f"agree: {r['ranks_agree']}; path: {r.get('tp_path')} | equal |")
    elif r:
        ok = False
        lines.append(f"| TP=2 greedy tokens, tiny model | error: {r['error']} | equal |")
    r = res.get("device_map_logits_opt-1.3b")
    if r:
        ok &= r["pass"]
        lines.append(f"| device_map over 2 GPUs, OPT-1.3b: patched vs fp32 | max err {r['ours_max_err']:.4f} (unpatched "
                     f"same split {r['torch_fp16_max_err']:.4f}; {r['swapped']} modules swapped; generate ok: "
                     f"{r['generate_ok']}) | fp16 rule: {'pass' if r['pass'] else 'FAIL'} |")
    for key, label, target in (("tp_opt-66b", "OPT-66b fp16 TP=2 decode", "<= 1.3x floor (~29 ms)"),
                               ("tp_opt-30b", "OPT-30b fp16 TP=2 decode", "reported"),
                               ("single_opt-30b", "OPT-30b fp16 one GPU decode", "reported"),
                               ("tp_opt-66b_int8", "OPT-66b int8 weight-only TP=2 decode", "reported")):
        r = res.get(key)
        if r and "decode_ms_per_token" in r:
            verdict = ""
            if key == "tp_opt-66b" and r.get("x_floor") is not None:
                verdict = f": {'pass' if r['x_floor'] <= 1.3 else 'MISSED'}"
            lines.append(f"| {label} | {_ms(r['decode_ms_per_token'])} ms/token, {r['grouped_ms_per_token']:.2f} in "
                         f"{r['group_steps']}-step replays ({_f(r.get('x_floor'), '.2f')}x the weight-read "
                         f"floor {_f(r['floor_ms'])} ms = {r['weight_gb_per_gpu']:.1f} GB / {_f(r['copy_gbps'], '.0f')} "
                         f"GB/s); peak {', '.join(_f(g) for g in r['peak_gib_per_gpu'])} GiB per GPU; build "
                         f"{r['build_s']:.0f} s; graphs: {r['graphs']} | {target}{verdict} |")
        elif r:
            lines.append(f"| {label} | error: {r.get('error')} | {target} |")
    r = res.get("tp_opt-66b")
    if r and "prefill_ms" in r:
        lines.append(f"| OPT-66b fp16 TP=2 prefill 1x{PREFILL} | {_ms(r['prefill_ms'])} ms | reported |")
    a, b = res.get("single_opt-30b"), res.get("tp_opt-30b")
    if a and b and "decode_ms_per_token" in a and "decode_ms_per_token" in b:
        s = a["decode_ms_per_token"]["median"] / b["decode_ms_per_token"]["median"]
        lines.append(f"| OPT-30b TP=2 speed-up over one GPU (per-step medians) | {s:.2f}x (2-GPU efficiency "
                     f"{s / 2:.0%}) | reported |")
    r = res.get("device_map_opt-66b")
    if r:
        p, u = r.get("patched", {}), r.get("unpatched_eager", {})
        lines.append(f"| OPT-66b device_map=auto over {r['gpus']}: patched decode | {_ms(p.get('decode_ms_per_token'))} "
                     f"ms/token ({_f(r.get('x_floor'), '.2f')}x the sequential floor {_f(r['sequential_floor_ms'])} ms = "
                     f"{r['weight_gb']:.1f} GB / {_f(r['copy_gbps'], '.0f')} GB/s); path: {p.get('path', p.get('error'))}"
                     f" | reported (floor ~44 ms) |")
        lines.append(f"| OPT-66b device_map=auto: unpatched eager decode (same run) | "
                     f"{_ms(u.get('decode_ms_per_token'))} ms/token | reported |")
    for name, value in errors.items():
        if name not in parts:
            ok = False
            lines.append(f"| {name} | NOT MEASURED: {value['results'].get('error')} | see its log |")
    for group, names in (("tp", TP_PARTS), ("single", SINGLE_PARTS)):
        for p in missing(group, names):
            if f"{group}_{p}" not in errors:
                ok = False
                lines.append(f"| {group}_{p} | NOT RUN (timeout or crash: see its log) | |")
    eager = sorted(k for k, v in parts.items() if v["environment"].get("tp_graphs_env") == "0")
    lines += ["", f"Parts re-run eagerly (FUSEINFER_TP_GRAPHS=0, after the graph run failed): {eager or 'none'}. "
              "OPT-66b int8 weight-only on one GPU: bench/bench_opt66b_int8.py (the int8 stage)."]
    lines += memory_phase_lines(res)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "parallel.md").write_text("\n".join(lines) + "\n")
    (RESULTS_DIR / "parallel.json").write_text(json.dumps({"parts": parts, "errors": errors, "pass": ok}, indent=1,
                                                          default=str))
    print("\n".join(lines))
    return 0 if ok else 1


def memory_phase_lines(res: dict) -> list[str]:
    """parallel.md's memory section: per part and GPU, allocated after each phase and the phase's own peak (GiB;
    peaks reset between phases), so the phase that sets the reported peak shows."""
    rows = []
    for key, r in res.items():
        for rank, phases in enumerate((r or {}).get("memory_phases_per_gpu") or []):
            for name, m in (phases or {}).items():
                if m:
                    rows.append(f"| {key} | {rank} | {name} | {m['allocated_gib']:.2f} | {m['peak_gib']:.2f} |")
    if not rows:
        return []
    return ["", "### Memory by phase (GiB per GPU; torch.cuda.memory_allocated after the phase, "
            "max_memory_allocated during it, peak reset between phases)", "",
            "| part | GPU | phase | allocated after | peak during |", "|---|---|---|---|---|"] + rows


def main(argv: list[str]) -> int:
    global SMALL
    SMALL = "--small" in argv
    args = [a for a in argv if a != "--small"]
    what, parts = (args[0] if args else ""), args[1:]
    torch.set_grad_enabled(False)  # inference only (the tiny model's checkpoint parameters require grad)
    if what == "tp":
        return main_tp(parts or list(TP_PARTS))
    if what == "single":
        return main_single(parts or list(SINGLE_PARTS))
    if what == "missing":  # the TP parts without a result (the stage script's eager re-run)
        print(" ".join(missing("tp", TP_PARTS)))
        return 0
    if what == "report":
        return main_report()
    print(f"usage: {sys.argv[0]} tp|single [PART ...] | missing | report [--small] (tp under torchrun "
          "--nproc-per-node 2)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
