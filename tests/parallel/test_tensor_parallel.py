"""Tensor parallel on CPU: two processes over gloo shard a small OPT and must give the unsharded model's logits and
greedy tokens (patched path, fused ops' references on CPU; and the unfused path after unpatch); bad input raises
one clear error on every rank without hanging."""
from __future__ import annotations

import copy
import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fuseinfer
from conftest import random_opt
from fuseinfer.parallel import sharding

IDS = dict(low=2, high=512, size=(2, 9))


def _model(**overrides):
    model = random_opt(seed=0, **{"num_hidden_layers": 2, **overrides})
    with torch.no_grad():  # non-zero biases: a row-parallel bias added on every rank would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.05 * torch.randn_like(p))
    return model


def _error(fn) -> str | None:
    try:
        fn()
    except fuseinfer.FuseInferError as exc:
        return str(exc)
    return None


def _worker(rank: int, size: int, init_file: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    from fuseinfer.parallel import tensor_parallel

    result = {}
    torch.manual_seed(1)
    ids = torch.randint(**IDS)
    # bad input first: every rank raises, the group stays usable
    three_heads = _model(hidden_size=96, num_attention_heads=3, ffn_dim=128)
    state = {k: v.clone() for k, v in three_heads.state_dict().items()}
    result["heads"] = _error(lambda: tensor_parallel(three_heads))
    result["heads_untouched"] = all(torch.equal(v, three_heads.state_dict()[k]) for k, v in state.items())
    result["disagree"] = _error(lambda: tensor_parallel(_model(num_hidden_layers=2 + rank)))
    result["size"] = _error(lambda: tensor_parallel(_model(), tp_size=4))
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    dispatched = _model()  # (as dispatch_model leaves it: a hook on each block)
    add_hook_to_module(dispatched.model.decoder.layers[0], AlignDevicesHook(execution_device="cpu"))
    one_device = _model()  # from_pretrained(device_map={"": "cpu"}) records a map but adds no hook: accepted
    one_device.hf_device_map = {"": "cpu"}
    result["one_device_map_ok"] = sharding._local_error(one_device, 2, None, torch.device("cpu"), "gloo", None)
    result["dispatched"] = _error(lambda: tensor_parallel(dispatched))
    result["cuda_on_gloo"] = _error(lambda: tensor_parallel(_model(), device="cuda:0"))
    result["one_rank"] = _error(lambda: tensor_parallel(_model() if rank == 0 else _model().train()))
    # a failure while sharding on one rank only (an OOM, say): every rank raises it, none waits on the other
    from fuseinfer.parallel import meta_model, random_init

    def init(name, shape, dtype, device):
        if rank == 1 and name.endswith("layers.1.fc1.weight"):
            raise RuntimeError("CUDA out of memory (simulated)")
        return random_init(0)(name, shape, dtype, device)

    result["shard_fails"] = _error(lambda: tensor_parallel(meta_model(_model().config, torch.float32), init=init))
    # the real thing
    model = _model()
    reference = copy.deepcopy(model)
    expected = reference(ids).logits
    report = tensor_parallel(model)
    result["report"] = str(report)
    result["shard_shapes"] = [list(model.model.decoder.layers[0].self_attn.q_proj.weight.shape),
                              list(model.model.decoder.layers[0].fc2.weight.shape)]
    result["row_bias"] = model.model.decoder.layers[0].fc2.bias is not None
    result["logits_err"] = (model(ids).logits - expected).abs().max().item()
    fuseinfer.patch(reference)
    want = fuseinfer.generate(reference, ids, max_new_tokens=6)
    result["generate_equal"] = torch.equal(fuseinfer.generate(model, ids, max_new_tokens=6), want)
    result["hf_generate_equal"] = torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    result["path"] = model._fuseinfer_sessions[2].path
    beams = dict(max_new_tokens=4, num_beams=2, do_sample=False)  # transformers' loop over fuseinfer's cache
    result["beam_equal"] = torch.equal(model.generate(ids, **beams), reference.generate(ids, **beams))
    fuseinfer.unpatch(model)
    result["unfused_err"] = (model(ids).logits - expected).abs().max().item()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_tp2_matches_the_unsharded_model(tp_results):
    for r in tp_results:
        assert r["shard_shapes"] == [[32, 64], [64, 64]]  # q_proj rows (E/2, E), fc2 columns (E, F/2)
        assert r["logits_err"] < 1e-5 and r["unfused_err"] < 1e-5
        assert r["generate_equal"] and r["hf_generate_equal"] and r["beam_equal"]
        assert "tensor parallel" in r["path"] and "TPFusedOPTDecoderLayer" in r["report"]
    assert tp_results[0]["row_bias"] and not tp_results[1]["row_bias"]  # fc2's bias on rank 0 only


def test_tp_bad_input_raises_on_every_rank(tp_results):
    for r in tp_results:
        assert "num_attention_heads=3 is not divisible by the tensor-parallel size 2" in r["heads"]
        assert r["heads_untouched"]
        assert "ranks disagree on the model" in r["disagree"]
        assert "tp_size=4 but the process group has 2 rank(s)" in r["size"]
        assert "dispatched by accelerate" in r["dispatched"]
        assert r["one_device_map_ok"] is None
        assert "needs the NCCL backend" in r["cuda_on_gloo"]
        assert r["one_rank"].startswith("rank 1: the model is in training mode")
        assert r["shard_fails"].startswith("rank 1: RuntimeError: CUDA out of memory (simulated)")


def test_tensor_parallel_needs_a_process_group():
    with pytest.raises(fuseinfer.FuseInferError, match="init_distributed"):
        sharding.tensor_parallel(_model())


def test_more_ranks_than_gpus_and_no_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    why = sharding._local_error(_model(), 2, None, torch.device("cuda", 0), "nccl", None)
    assert "larger than the 1 visible GPU(s)" in why
    from fuseinfer.parallel import dist as fdist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(fuseinfer.FuseInferError, match="built without NCCL"):
        fdist.init_distributed()
    monkeypatch.delenv("RANK")
    with pytest.raises(fuseinfer.FuseInferError, match="torchrun"):
        fdist.init_distributed()


def test_every_lazy_public_name_resolves():
    """fuseinfer.parallel's names (imported on first use) all resolve, wherever their module now lives."""
    import fuseinfer.parallel as par

    for name in par.__all__:
        assert getattr(par, name) is not None, name
