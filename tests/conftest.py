"""Shared fixtures: where the shared assets live, tiny OPT and Llama models, and the visible skip of GPU tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import DEVICES

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FUSEINFER_SHARED", REPO.parent / "shared"))
TINY_MODEL = SHARED / "models" / "opt-wt2-tiny"
TINY_LLAMA = SHARED / "models" / "llama-wt2-tiny"  # trained 4-layer Llama: hidden 256, 4 heads, 2 KV heads, tied
WIKITEXT = SHARED / "data" / "wikitext-2-raw"


def pytest_configure(config):
    """In CI (CI=true) the shared assets must be there: without them ~60 tests would skip and the run look green."""
    if os.environ.get("CI") == "true" and not (TINY_MODEL / "config.json").exists():
        raise pytest.UsageError(f"CI=true but the shared assets are not at {SHARED} (no {TINY_MODEL}/config.json): "
                                "set FUSEINFER_SHARED to the shared/ folder")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With FUSEINFER_TEST_FAILURES=path, each failure's report is appended to that file as the test ends, not in
    the summary at the end of the run: a run cut short by a time limit (a GPU machine's) still says why its
    failures failed. With pytest-xdist this runs in the controlling process, which receives every worker's report."""
    path = os.environ.get("FUSEINFER_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    """'cpu', and 'cuda' marked ``gpu`` (listed as skipped without a GPU): the op tests' device parameter. Session
    scope, so that hypothesis tests may take it too."""
    return request.param


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    if not (TINY_MODEL / "config.json").exists():
        pytest.skip(f"shared model not found at {TINY_MODEL}; set FUSEINFER_SHARED to the shared/ folder")
    return TINY_MODEL


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    if not (TINY_LLAMA / "config.json").exists():
        pytest.skip(f"shared model not found at {TINY_LLAMA}; set FUSEINFER_SHARED to the shared/ folder")
    return TINY_LLAMA


def random_llama(model_type: str = "llama", seed: int = 0, dtype=torch.float32, device="cpu", **overrides):
    """A small randomly initialised Llama / Mistral / Qwen2 causal LM in eval mode (grouped-query: 4 heads, 2 KV
    heads by default); ``overrides`` go to its config. RMSNorm weights perturbed so that they are exercised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs),
                                             attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.to(device=device, dtype=dtype)


def random_opt(seed: int = 0, dtype=torch.float32, device="cpu", **overrides):
    """A small randomly initialised OPTForCausalLM in eval mode; ``overrides`` go to OPTConfig."""
    from transformers import OPTConfig, OPTForCausalLM

    kwargs = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                  max_position_embeddings=256, word_embed_proj_dim=None, pad_token_id=1, dropout=0.0)
    kwargs.update(overrides)
    if kwargs["word_embed_proj_dim"] is None:
        kwargs["word_embed_proj_dim"] = kwargs["hidden_size"]
    torch.manual_seed(seed)
    cfg = OPTConfig(**kwargs)
    model = OPTForCausalLM(cfg).eval()
    with torch.no_grad():  # OPT's init leaves LayerNorms at (1, 0); perturb them so they are exercised
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(device=device, dtype=dtype)


def traced_by_compile(model, **inputs):
    """model(**inputs) through torch.compile(fullgraph=True) with a backend that runs dynamo's graphs as traced (no
    Inductor): its output, and the code of those graphs (where the registered ``torch.ops.fuseinfer.*`` calls show)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    out = torch.compile(model, fullgraph=True, backend=backend)(**inputs)
    return out, "".join(graphs)


def loss_and_grads(model, ids, mask, compile_=False):
    """Loss of a left-padded batch, and its gradients: the input embeddings' first (key ``inputs_embeds``), then every
    parameter's, in ``named_parameters`` order. A pad position's logits (which predict the next label) stay out of
    the loss: its query has no key to attend, which each attention implementation resolves its own way."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    fn = torch.compile(model) if compile_ else model
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)
    loss = fn(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {"inputs_embeds": embeds.grad, **{n: p.grad for n, p in model.named_parameters()}}


# The OPT layouts every patch test runs on: name -> OPTConfig overrides
VARIANTS = {
    "pre_ln": {},
    "post_ln_project_in_out": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # the opt-350m shape
    "odd_hidden96_3heads": dict(hidden_size=96, num_attention_heads=3, ffn_dim=200),
    "no_bias": dict(enable_bias=False),
    "no_final_ln": dict(_remove_final_layer_norm=True),
    "ln_without_affine": dict(layer_norm_elementwise_affine=False),
}


@pytest.fixture(autouse=True)
def _restore_knobs():
    """The CLIs set the knobs their flags stand for in this process's environment (for the processes they start):
    put every FUSEINFER_* variable back after each test, so no test sees another's flags."""
    before = {k: v for k, v in os.environ.items() if k.startswith("FUSEINFER_")}
    yield
    for k in [k for k in os.environ if k.startswith("FUSEINFER_") and k not in before]:
        del os.environ[k]
    os.environ.update(before)


@pytest.fixture
def no_wikitext(monkeypatch, tmp_path):
    """WikiText-2 nowhere that fuseinfer.core.data looks: no FUSEINFER_DATA_DIR, a shared folder without it, and
    ``datasets`` as if offline."""
    from fuseinfer.core import data

    monkeypatch.delenv("FUSEINFER_DATA_DIR", raising=False)
    monkeypatch.setenv("FUSEINFER_SHARED", str(tmp_path / "no-shared"))
    monkeypatch.setattr(data, "_rows_from_datasets", lambda split: None)


@pytest.fixture
def set_knob(monkeypatch):
    """set_knob(name, value): set a FUSEINFER_* knob for the test, in the environment and in the CUDA extension
    (which takes its switches from fuseinfer.core.knobs, not from the environment); both restored afterwards."""
    from fuseinfer.core import knobs

    def set_(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        knobs.push()

    yield set_
    monkeypatch.undo()
    knobs.push()
