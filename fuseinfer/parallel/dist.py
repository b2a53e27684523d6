"""Process-group setup for tensor parallel: ``init_distributed`` (torchrun's environment, checked, a timeout on every
collective, one GPU per rank) and an all-gather that turns one rank's error into the same error on every rank (so
no rank waits on a collective its peer will never join). NCCL's own settings (e.g. NVLink multicast) are left to the
environment of the launch."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from fuseinfer.core.errors import FuseInferError

DEFAULT_TIMEOUT_S = 300
_LAUNCH = "launch with torchrun --nproc-per-node N your_script.py, which sets RANK, WORLD_SIZE and LOCAL_RANK"


def env_int(name: str, minimum: int = 0, default: int | None = None) -> int | None:
    """The integer torchrun put in the environment variable ``name`` (``default`` when unset); one clear error
    naming the variable for a value that is not an integer >= ``minimum``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise FuseInferError(f"{name}={raw!r} is not an integer >= {minimum}: unset it or {_LAUNCH}")
    return value


def torchrun_env() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) from torchrun's environment, checked (LOCAL_RANK defaults to RANK)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise FuseInferError(f"init_distributed needs torchrun's environment (RANK, WORLD_SIZE): {_LAUNCH}")
    world, rank = env_int("WORLD_SIZE", 1), env_int("RANK")
    if rank >= world:
        raise FuseInferError(f"RANK={rank} is not below WORLD_SIZE={world}: {_LAUNCH}")
    return rank, world, env_int("LOCAL_RANK", default=rank)


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, seed: int = 0):
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) with a timeout on
    every collective; on CUDA, bind this rank to GPU LOCAL_RANK. ``backend`` None: NCCL when a GPU is visible, else
    gloo. Seeds torch's generators with ``seed`` on every rank (sampling then draws the same numbers everywhere).
    Returns the device this rank computes on. Calling it again after a successful call returns that device."""
    _, world, local = torchrun_env()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise FuseInferError("backend nccl needs a CUDA GPU, and none is visible: use backend='gloo' on CPU")
        if not dist.is_nccl_available():
            raise FuseInferError(f"this torch ({torch.__version__}) is built without NCCL: install a CUDA build of "
                                 "torch with NCCL, or use backend='gloo' (CPU tensors only)")
        if local >= torch.cuda.device_count():
            raise FuseInferError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s) are visible: "
                                 f"launch at most {torch.cuda.device_count()} processes per node "
                                 f"(torchrun --nproc-per-node {torch.cuda.device_count()}), not {world}")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    torch.manual_seed(seed)
    return device


def gather_errors(error: str | None, payload=None, group=None) -> list:
    """All-gather (error, payload) from every rank; raise the first rank's error on every rank, naming it.
    Returns the payloads in rank order."""
    items = [None] * dist.get_world_size(group)
    dist.all_gather_object(items, (error, payload), group=group)
    for rank, (err, _) in enumerate(items):
        if err is not None:
            raise FuseInferError(f"rank {rank}: {err}")
    return [p for _, p in items]


def rank0_print(*args, **kwargs) -> None:
    """print on rank 0 only (or when not distributed)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs)
