"""The software and hardware a run used, recorded with its results."""
from __future__ import annotations

import platform
import subprocess
from datetime import datetime, timezone

import torch

from fuseinfer.core import knobs
from fuseinfer.core.extension import extension_status
from fuseinfer.core.version import __version__


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def environment(device: torch.device) -> dict:
    """When (UTC), Python, platform, torch / CUDA / transformers / fuseinfer versions, the extension's status and
    switches set off their defaults, and the GPU."""
    import transformers

    env = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "fuseinfer": __version__,
        "fuseinfer_extension": extension_status(device),
        "cpu_threads": torch.get_num_threads(),
        "switches": knobs.changed_switches(),  # the extension's switches off their defaults
        "gpu": None, "gpu_capability": None, "gpu_memory_mib": None, "driver": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}",
                   gpu_memory_mib=props.total_memory // 2**20, driver=_driver_version())
    return env
