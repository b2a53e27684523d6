"""torchrun's environment as ``init_distributed`` and the eval's ``--tp`` read it: a garbage RANK / WORLD_SIZE /
LOCAL_RANK is one clear error naming the variable, and the library sets no NCCL variable of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuseinfer
from fuseinfer.parallel import dist as fdist


def _not_an_int(text: str) -> bool:
    try:
        int(text.strip())
    except ValueError:
        return "\x00" not in text  # (an environment value cannot hold NUL)
    return False


GARBAGE = st.one_of(st.text(max_size=8).filter(_not_an_int), st.integers(max_value=-1).map(str),
                    st.sampled_from(["1.5", "2e3", "", " ", "0x2", "one"]))
VALID = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(VALID)), value=GARBAGE)
def test_garbage_torchrun_variable_is_one_error_naming_it(name, value):
    # (mock.patch.dict, not monkeypatch: a function-scoped fixture is not reset between hypothesis examples)
    with mock.patch.dict(os.environ, {**VALID, name: value}), \
            pytest.raises(fuseinfer.FuseInferError, match=f"^{name}=") as info:
        fdist.init_distributed("gloo")
    assert "\n" not in str(info.value) and "torchrun" in str(info.value)


def test_rank_beyond_world_size_and_no_nccl_settings(monkeypatch):
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(fuseinfer.FuseInferError, match="RANK=2 is not below WORLD_SIZE=2"):
        fdist.init_distributed("gloo")
    assert not {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"} & set(os.environ)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "abc", "RANK": "0"}, {"WORLD_SIZE": "2", "RANK": "x"},
                                 {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "-1"}])
def test_eval_tp_with_garbage_variable_prints_one_error_line(env, tiny_model_path):
    run_env = {k: v for k, v in os.environ.items() if k not in VALID}
    run_env.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    r = subprocess.run([sys.executable, "-m", "fuseinfer.eval", "--model", str(tiny_model_path), "--tp", "2",
                        "--device", "cpu", "--skip-ppl"], capture_output=True, text=True, env=run_env, timeout=300)
    name = next(k for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE") if k in env and not env[k].isdigit())
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(f"error: {name}="), r.stderr
