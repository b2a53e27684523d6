"""transformers' own model tests on patched Llama-architecture models (Llama, Mistral, Qwen2): the suite runs twice,
unpatched and with every model it builds patched by ``fuseinfer.patch``, and each test that passes unpatched must pass
patched too, apart from the differences listed (and documented in docs/transformers_tests.md) as by design.

The copy under tests/third_party/transformers/ (its README says what it is) runs in its own pytest session, started
here in two subprocesses side by side (the patch hook wraps transformers' model classes, which must not leak into
this process); its plugin ``fuseinfer_patch`` installs the hook and records the outcomes. Where a checkout of
transformers at the installed version is at hand, ``TRANSFORMERS_TESTS_CHECKOUT=<checkout>`` also runs its
``tests/models/{llama,mistral,qwen2}/test_modeling_*.py`` (generation tests included) the same way.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

VENDORED = Path(__file__).resolve().parents[2] / "third_party" / "transformers"
VENDORED_VERSION = "5.23.0"  # the transformers release the copy comes from
FAMILIES = ("llama", "mistral", "qwen2")  # tests/models/<family>/: the families run, as the plugin patches them
OWN_MODULES = [f"tests/models/{f}/test_{f}_common.py" for f in FAMILIES]
UPSTREAM_MODULES = [f"tests/models/{f}/test_modeling_{f}.py" for f in FAMILIES]

# test name (parameterized variants share it) -> (the families it concerns, why it fails on a patched model by design)
BY_DESIGN = {
    "test_sdpa_can_dispatch_non_composite_models": (
        FAMILIES, "a patched model's config names fuseinfer's attention implementation, not 'sdpa'"),
    "test_can_set_attention_dynamically": (
        FAMILIES,
        "a patched model's config names fuseinfer's attention implementation, not the 'eager' it was built with"),
    "test_attention_outputs": (
        FAMILIES, "setting output_attentions on a patched model's config raises: transformers allows it only with "
                  "eager attention (output_attentions=True on the call works)"),
    "test_eager_matches_sdpa_inference": (
        ("mistral",), "the test gives Mistral a sliding window of 2 tokens, shorter than its inputs: fuseinfer's "
                      "attention has no window, and patch refuses such a model"),
}


def _name(test_id: str) -> str:
    """'path::Class::test_x_0_fp16' -> the test's name as BY_DESIGN spells it (with parameterized variants)."""
    name = test_id.rsplit("::", 1)[-1]
    for key in BY_DESIGN:
        if name == key or name.startswith(key + "_"):
            return key
    return name


def _family(test_id: str) -> str | None:
    """'tests/models/mistral/test_x.py::...' -> 'mistral'."""
    parts = test_id.split("::", 1)[0].split("/")
    return parts[parts.index("models") + 1] if "models" in parts[:-1] else None


def _by_design(test_id: str) -> bool:
    name = _name(test_id)
    return name in BY_DESIGN and _family(test_id) in BY_DESIGN[name][0]


def _run(root: Path, modules: list[str], tmp_path: Path, patched: bool) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / ("patched.json" if patched else "unpatched.json")
    env = dict(os.environ, HFSUITE_OUT=str(out), HFSUITE_PATCH="1" if patched else "0",
               PYTHONPATH=os.pathsep.join([str(root), str(VENDORED), str(VENDORED.parents[2]),
                                           os.environ.get("PYTHONPATH", "")]))
    ini = ["-c", str(VENDORED / "pytest.ini")] if root == VENDORED else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "fuseinfer_patch", "-p", "no:cacheprovider", "-rf",
           "--tb=short", *ini, "--rootdir", str(root), *modules]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def _compare(root: Path, modules: list[str], tmp_path: Path) -> None:
    if importlib.util.find_spec("parameterized") is None:
        pytest.skip("transformers' tests need the parameterized package (pip install parameterized; setup.py's test "
                    "extra has it)")
    runs = [_run(root, modules, tmp_path, patched) for patched in (False, True)]  # side by side: half the wall time
    try:
        logs = [proc.communicate(timeout=900)[0] for proc, _ in runs]
    finally:  # (a run past the timeout must not outlive the test)
        for proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for (proc, out), log, what in zip(runs, logs, ("unpatched", "patched")):
        assert out.exists(), f"the {what} run recorded nothing (exit {proc.returncode}):\n{log[-4000:]}"
    base, patched = (json.loads(out.read_text()) for _, out in runs)

    passed = {t for t, o in base["outcomes"].items() if o == "passed"}
    assert not base["patched"], "the unpatched run patched models"
    for module in modules:  # every family's module ran, and the hook reached its models
        family = _family(module)
        ran = {t for t in passed if _family(t) == family}
        assert len(ran) >= 50, f"only {len(ran)} {family} tests passed unpatched:\n{logs[0][-4000:]}"
        # most passing tests build (and so patch) at least one model
        assert len(set(patched["patched"]) & ran) >= len(ran) // 2, \
            f"the patched run patched (almost) no {family} models"

    lost = sorted(t for t in passed if patched["outcomes"].get(t) != "passed")
    unexpected = [t for t in lost if not _by_design(t)]
    assert not unexpected, (f"{len(unexpected)} tests pass unpatched but not patched: {unexpected}\n"
                            f"{logs[1][-8000:]}")
    # a by-design entry that now passes (or no longer runs) is stale: the table must say what happens
    seen = {(_name(t), _family(t)) for t in lost}
    stale = sorted({(_name(t), _family(t)) for t in passed if _by_design(t)} - seen)
    assert not stale, f"listed as failing patched by design, but pass patched: {stale} (update BY_DESIGN and the docs)"


def _check_version():
    import transformers

    if transformers.__version__ != VENDORED_VERSION:
        pytest.skip(f"the vendored transformers tests are {VENDORED_VERSION}'s; transformers "
                    f"{transformers.__version__} is installed")


def test_common_model_tests_pass_patched(tmp_path):
    """transformers' ModelTesterMixin on the five classes of Llama, Mistral and Qwen2 each (and our generation
    checks), patched vs not."""
    _check_version()
    _compare(VENDORED, OWN_MODULES, tmp_path)


def test_upstream_modules_pass_patched(tmp_path):
    """transformers' own test_modeling_{llama,mistral,qwen2}.py from a checkout at the installed version, patched vs
    not."""
    root = os.environ.get("TRANSFORMERS_TESTS_CHECKOUT")
    if not root:
        pytest.skip("set TRANSFORMERS_TESTS_CHECKOUT to a checkout of transformers at the installed version to run "
                    "its Llama, Mistral and Qwen2 tests on patched models")
    modules = [m for m in UPSTREAM_MODULES if (Path(root) / m).exists()]
    if not modules:
        pytest.skip(f"TRANSFORMERS_TESTS_CHECKOUT has none of {', '.join(UPSTREAM_MODULES)}")
    _compare(Path(root), modules, tmp_path)


@pytest.mark.parametrize("config_level", [False, True], ids=["call", "config"])
def test_training_mode_returns_the_attention_weights(config_level):
    """A model patched in eval mode, then put in training mode, returns the attention weights asked for (by the call
    or the config), as the unpatched model does: same weights, same output, gradients through them (the common
    tests' retain-grad test found them missing: SDPA ran, which forms none)."""
    import torch
    from conftest import random_llama

    import fuseinfer

    ref, ours = random_llama(seed=3), random_llama(seed=3)
    for model in (ref, ours):
        model.config._attn_implementation = "eager"  # (the weights need eager attention in the unpatched model)
        # (set before patching: transformers refuses output_attentions on a config whose attention is not eager)
        model.config.output_attentions = config_level
    fuseinfer.patch(ours)
    assert ours.config._attn_implementation == "fuseinfer"
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    outs = []
    for model in (ref, ours):
        model.train()
        out = model.model(input_ids=ids, attention_mask=mask, **({} if config_level else {"output_attentions": True}))
        assert len(out.attentions) == model.config.num_hidden_layers
        out.attentions[0].retain_grad()
        out.last_hidden_state.sum().backward()
        assert out.attentions[0].grad is not None
        outs.append(out)
    for a, b in zip(outs[0].attentions, outs[1].attentions):
        torch.testing.assert_close(b, a)  # (B, H, S, S), grouped-query k / v repeated to the 4 heads
    torch.testing.assert_close(outs[1].last_hidden_state, outs[0].last_hidden_state)


def test_by_design_differences_are_per_family_and_documented():
    """A difference listed for one family excuses no other family's failure, parameterized variants share their
    test's entry, and every entry has its row in the documentation's table."""
    mistral, qwen2 = (f"tests/models/{f}/test_{f}_common.py::C::test_eager_matches_sdpa_inference_01_fp16_pad_left"
                      for f in ("mistral", "qwen2"))
    assert _by_design(mistral) and not _by_design(qwen2)
    assert _by_design("tests/models/qwen2/test_qwen2_common.py::C::test_attention_outputs")
    assert not _by_design("tests/models/llama/test_llama_common.py::C::test_save_load")
    assert _family("tests/models/qwen2/test_modeling_qwen2.py::C::test_x") == "qwen2"
    doc = (Path(__file__).resolve().parents[3] / "docs" / "transformers_tests.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `test_")]
    for name, (families, _) in BY_DESIGN.items():
        row = next((r for r in rows if r.startswith(f"| `{name}`")), None)
        assert row is not None, f"{name} has no row in docs/transformers_tests.md"
        scope = row.split(" | ")[1]
        assert scope == "all" if families == FAMILIES else all(f.lower() in scope.lower() for f in families), row
