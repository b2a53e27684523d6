"""The README as a user meets it: its commands run as written (every flag exists, every required flag is given),
no text speaks of the project's own machines or scripts, one results table, at most 2,000 words. And all text a
user or contributor reads (docs, --help of the CLIs and of the bench / tools scripts, whose module docstrings are
their argparse descriptions, the package's docstrings and messages, skip reasons) names no issue number or machine
path."""
from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
FORBIDDEN = re.compile(r"our machines?|the GPU machine|tools/\w+\.sh", re.I)
# issue numbers ("issue 36", "Issue 4's", "#41"; not an upstream "pytorch/pytorch#144455") and machine paths
PRIVATE = re.compile(r"\bissues? ?#?\d+\b|(?<![\w/])#\d{2,}\b|(?<![\w.])/(?:work|root)/|\bthe device tool\b|"
                     r"\bour machines?\b", re.I)
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
    assert not PRIVATE.search(help_text(cli)), PRIVATE.search(help_text(cli)).group(0)


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
            if FORBIDDEN.search(m.group(0)) or PRIVATE.search(m.group(0)):
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


# ---- issue numbers and machine paths, in everything a user or contributor reads

def _strings(path: Path, docstrings_only: bool) -> list[tuple[int, str]]:
    """(line, text) of a Python file's module docstring, or of all its string constants (docstrings, messages,
    help texts; comments are not strings)."""
    tree = ast.parse(path.read_text())
    if docstrings_only:
        doc = ast.get_docstring(tree, clean=False)
        return [(1, doc)] if doc else []
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def user_texts(group: str) -> list[tuple[str, str]]:
    """(where, text) of one group of user-facing text."""
    if group == "docs":
        files = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md")),
                 *sorted((REPO / "examples").iterdir()), *sorted((REPO / "tools").glob("*.sh"))]
        return [(str(f.relative_to(REPO)), f.read_text()) for f in files if f.is_file()]
    if group == "script docstrings":  # their --help: argparse(description=__doc__)
        files = [*sorted((REPO / "bench").glob("*.py")), *sorted((REPO / "tools").glob("*.py"))]
        return [(f"{f.relative_to(REPO)}:{line}", s) for f in files for line, s in _strings(f, True)]
    assert group == "package strings"
    return [(f"{f.relative_to(REPO)}:{line}", s) for f in sorted((REPO / "fuseinfer").rglob("*.py"))
            for line, s in _strings(f, False)]


@pytest.mark.parametrize("group", ["docs", "script docstrings", "package strings"])
def test_user_facing_text_names_no_issue_or_machine_path(group):
    hits = [f"{where}: {m.group(0)!r}" for where, text in user_texts(group) for m in PRIVATE.finditer(text)]
    assert not hits, hits


def test_the_private_pattern():
    bad = ["Target (issue 36, H100)", "Issue 4 asks", "issue 5's definition", "see #41", "issues 35 / 36",
           "in /work/main/.venv", "/root/.cache", "through the device tool", "installed on our machines"]
    good = ["pytorch/pytorch#144455: no cuptiFinalize", "issues four m16n8k16 mmas", "/tmp/fuseinfer-gpu",
            "$FUSEINFER_SHARED/work/x", "a helper", "a fast-decode session", "#1 and #2"]
    assert [s for s in bad if not PRIVATE.search(s)] == []
    assert [s for s in good if PRIVATE.search(s)] == []
