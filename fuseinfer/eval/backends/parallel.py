"""``python -m fuseinfer.eval --tp N`` (launched by ``torchrun --nproc-per-node N``): the fuseinfer backend on a
model sharded by ``tensor_parallel`` over the N ranks; the one-GPU backends report that they do not run. Every
rank runs the same plan; only rank 0 prints and writes (``fuseinfer/eval/cli.py``). No backend name of its own:
the runner asks :func:`tp_backend` for the class that runs a registered backend under ``--tp``."""
from __future__ import annotations

import atexit

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.harness.backends import Backend, FuseInferBackend
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.models import load_model, model_stats


def tp_device(tp: int, device: str | None) -> torch.device:
    """Join torchrun's process group (NCCL on GPUs, gloo for --device cpu); this rank's device."""
    from fuseinfer.parallel.dist import env_int, init_distributed

    try:
        world = env_int("WORLD_SIZE", 1)
    except FuseInferError as exc:
        raise EvalError(str(exc)) from None
    if world != tp:
        raise EvalError(f"--tp {tp} runs one process per GPU: launch with torchrun --nproc-per-node {tp} -m "
                        f"fuseinfer.eval ... --tp {tp} (WORLD_SIZE is {world or 'unset'})")
    if device not in (None, "cuda", "cpu"):
        raise EvalError(f"--device {device} with --tp: each rank takes its own GPU (LOCAL_RANK); pass --device cuda "
                        "or leave it out (--device cpu runs gloo on CPU, for tests)")
    try:
        device = init_distributed("gloo" if device == "cpu" else None)
    except FuseInferError as exc:
        raise EvalError(str(exc)) from None
    atexit.register(_leave)
    return device


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def tp_backend(cls: type[Backend], tp: int) -> type[Backend]:
    """The class that runs backend ``cls`` under --tp ``tp``."""
    if tp == 1:
        return cls
    if cls is FuseInferBackend:
        return type("TensorParallelFuseInferBackend", (TensorParallelBackend,), {"tp": tp})

    class OneGPUOnly(cls):
        @classmethod
        def unavailable_reason(cls_, device):
            return f"runs on one GPU; with --tp {tp} only the fuseinfer backend runs (tensor parallel)"

    return OneGPUOnly


class TensorParallelBackend(FuseInferBackend):
    """fuseinfer.parallel.tensor_parallel(model): this rank's shard patched, NCCL all-reduces in the decode graph."""

    summary = ("fuseinfer tensor parallel: attention and MLP input projections sharded by columns, output "
               "projections by rows; NCCL all-reduce")
    tp = 2

    def load(self):
        from fuseinfer.harness.materialize import meta_model, random_init
        from fuseinfer.parallel.sharding import tensor_parallel

        if self.source.random_weights:  # on meta; each rank draws only its shard on its GPU
            model, init = meta_model(self.config, self.dtype), random_init(self.seed)
        else:  # the checkpoint on the CPU; each rank copies its shard to its GPU
            model, init = load_model(self.source, self.config, self.dtype, torch.device("cpu"), self.seed), None
        self.stats = model_stats(model)  # (of the whole model)
        self.report = tensor_parallel(model, self.tp, device=self.device, init=init)
        self.model, self.decode = model, "not run"

    def details(self):
        return {**super().details(), "tensor_parallel": self.tp}

    def close(self):
        self.end()
        self.model = None  # (unpatch would keep the shards, unfused: nothing to restore)
