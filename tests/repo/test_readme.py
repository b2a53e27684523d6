"""The README as a user meets it: its commands run as written (every flag exists, every required flag is given),
no text speaks of the project's own machines or scripts, one results table, at most 2,000 words."""
from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
FORBIDDEN = re.compile(r"our machines?|the GPU machine|tools/\w+\.sh", re.I)
CLIS = {"eval": ["fuseinfer.eval"], "profile": ["fuseinfer.profile"], "export onnx": ["fuseinfer.export", "onnx"],
        "export tensorrt": ["fuseinfer.export", "tensorrt"], "export": ["fuseinfer.export"]}


@functools.cache
def help_text(cli: str) -> str:
    module, *sub = CLIS[cli]
    proc = subprocess.run([sys.executable, "-m", module, *sub, "--help"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def required_flags(help_out: str) -> set[str]:
    """The flags of the usage line outside [...]: what a command must give."""
    usage = help_out.split("\n\n")[0]
    while re.search(r"\[[^\[\]]*\]", usage):
        usage = re.sub(r"\[[^\[\]]*\]", "", usage)
    return set(re.findall(r"--[\w-]+", usage))


def readme_commands() -> list[tuple[str, str]]:
    """(cli, its arguments) of each fuseinfer command in the README: code-block lines and inline code."""
    spans = re.findall(r"```bash\n(.*?)```", README, re.S)
    spans = [line for block in spans for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", README)
    out = []
    for span in spans:
        span = span.split("#")[0]
        m = re.search(r"(?:-m fuseinfer\.|^)(eval|profile|export(?: (?:onnx|tensorrt))?)\b(.*)", span.strip())
        if m and ("fuseinfer." in span or m.group(1).startswith("export ")):
            out.append((m.group(1), m.group(2)))
    return out


def test_readme_lists_the_commands():
    clis = {cli for cli, _ in readme_commands()}
    assert {"eval", "profile", "export onnx", "export tensorrt"} <= clis


@pytest.mark.parametrize("cli, args", readme_commands())
def test_readme_command_matches_its_help(cli, args):
    """Every flag the README gives exists; every flag the CLI requires is given (the profiler's --out was not)."""
    text = help_text(cli)
    given, known = set(re.findall(r"--[\w-]+", args)), set(re.findall(r"--[\w-]+", text))
    assert given <= known, f"{cli}{args}: unknown {given - known}"
    assert required_flags(text) <= given, f"{cli}{args}: missing {required_flags(text) - given}"


@pytest.mark.parametrize("cli", ["eval", "profile", "export", "export onnx", "export tensorrt"])
def test_help_texts_name_no_private_machine_or_script(cli):
    assert not FORBIDDEN.search(help_text(cli)), FORBIDDEN.search(help_text(cli)).group(0)


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md"])
def test_docs_name_no_private_machine_or_script(doc):
    hit = FORBIDDEN.search((REPO / doc).read_text())
    assert hit is None, hit and hit.group(0)


def test_readme_is_short_with_one_results_table():
    assert len(README.split()) <= 2000
    results = README.split("## Results", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"^\| --- ", results, re.M)
    assert len(tables) == 1


def test_skip_reasons_name_no_private_machine_or_script():
    """pytest's skip reasons are user-facing: collected from the tests' source."""
    hits = []
    for path in (REPO / "tests").rglob("*.py"):
        for m in re.finditer(r"(?:skip(?:if)?\(|reason=|NO_\w+ = )[^\n]*", path.read_text()):
            if FORBIDDEN.search(m.group(0)):
                hits.append(f"{path.relative_to(REPO)}: {m.group(0)[:80]}")
    assert not hits, hits


def test_the_install_lines_are_what_ci_runs():
    """Every `pip install` of the README's install block is run by .ci/run as written (a newcomer types what CI
    runs)."""
    block = README.split("## Install and test", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [c.strip() for line in block.splitlines() if not line.lstrip().startswith("#")
                for c in line.split("&&") if c.strip().startswith("pip install")]
    ci = (REPO / ".ci" / "run").read_text()
    assert len(commands) == 4, commands
    for c in commands:
        assert "python -m pip install -q " + c.removeprefix("pip install ") in ci, c
