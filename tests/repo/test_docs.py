"""The documentation stays true to the code: every ``fuseinfer/...py`` path and ``fuseinfer.x.y`` name that README.md
and docs/*.md give exists; the contributor guide's toy op (its wrapper and its test file, taken from the guide's code
blocks) imports and passes its own CPU tests; the README and the history stay within their word budgets.

A path or module the guide asks a contributor to create is exempt: the rows of a recipe table whose "change" cell
starts with "new" name such files, and every path those rows give (and its module name) is skipped in that
document.
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GUIDE = REPO / "docs" / "contributing.md"

PATH = re.compile(r"(?<![\w/.<>-])(?:fuseinfer|tests)/[\w/]*\w\.py\b")
NAME = re.compile(r"(?<![\w/.<>-])fuseinfer(?:\.[A-Za-z_]\w*)+(?![\w/])")  # (not a schema: fuseinfer.onnx/2)
FILE_SUFFIXES = ("h", "py", "cu", "cpp", "md", "whl", "json", "so")  # `fuseinfer.h` is a file, not a module
NOT_CHECKED = ("fuseinfer._C",)  # the compiled extension: absent on a machine without CUDA


def new_paths(text: str) -> set[str]:
    """Paths named in the table rows whose second cell starts with "new" (files a recipe creates)."""
    out = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) >= 2 and cells[1].lower().startswith("new"):
            out.update(PATH.findall(cells[0]))
    return out


def _module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def missing_names(text: str) -> list[str]:
    """The paths and dotted names of ``text`` that do not exist (new files of the recipes exempt)."""
    exempt = new_paths(text)
    exempt_modules = {_module_of(p) for p in exempt}
    bad = [p for p in sorted(set(PATH.findall(text)) - exempt) if not (REPO / p).is_file()]
    for name in sorted(set(NAME.findall(text))):
        if name.rsplit(".", 1)[1] in FILE_SUFFIXES or name.startswith(NOT_CHECKED) or \
                any(name == m or name.startswith(m + ".") for m in exempt_modules):
            continue
        if not _resolves(name):
            bad.append(name)
    return bad


def _resolves(name: str) -> bool:
    """``name`` is a module of the package, or an attribute (chain) of one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        base = REPO.joinpath(*parts[:cut])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            obj = importlib.import_module(module)
            for attr in parts[cut:]:
                try:
                    obj = getattr(obj, attr)
                except (AttributeError, ImportError):  # (a lazy ``__getattr__`` may import)
                    return False
            return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_named_paths_and_modules_exist(doc):
    assert missing_names(doc.read_text()) == []


def test_the_checker_finds_a_missing_name_and_honours_new_rows():
    text = ("See `fuseinfer/patching.py`, `fuseinfer/nowhere.py`, `fuseinfer.core.knobs`, `fuseinfer.core.nowhere`,"
            " `fuseinfer.runtime.set_runtime`, `fuseinfer.runtime.nothing` and `csrc/fuseinfer.h`.\n\n"
            "| file | change |\n| --- | --- |\n| `fuseinfer/ops/brand_new.py` | new: the op |\n"
            "| `fuseinfer/ops/__init__.py` | import it |\n\nThen `fuseinfer.ops.brand_new.thing` runs.\n")
    assert missing_names(text) == ["fuseinfer/nowhere.py", "fuseinfer.core.nowhere", "fuseinfer.runtime.nothing"]


# ---- the toy op of the contributor guide, extracted and run

def _code_block_after(text: str, heading: str, lang: str) -> str:
    """The first ```lang block after the line that is exactly ``heading``."""
    after = text.split("\n" + heading + "\n", 1)
    assert len(after) == 2, f"{heading!r} not found in the contributor guide"
    m = re.search(rf"```{lang}\n(.*?)```", after[1], re.S)
    assert m, f"no {lang} block after {heading!r}"
    return m.group(1)


@pytest.fixture(scope="module")
def toy_op(tmp_path_factory):
    """The guide's ``scale_add`` module, written under a temporary folder and imported as ``scale_add`` (outside
    the package), once per session: its custom op registers with torch's dispatcher, which takes a name once."""
    if "scale_add" in sys.modules:
        return sys.modules["scale_add"]
    folder = tmp_path_factory.mktemp("toy_op")
    (folder / "scale_add.py").write_text(_code_block_after(GUIDE.read_text(), "`fuseinfer/ops/scale_add.py`:",
                                                           "python"))
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("scale_add")
    finally:
        sys.path.remove(str(folder))


def test_the_guides_toy_op_passes_its_cpu_tests(toy_op, tmp_path, monkeypatch):
    """The guide's test file, run against the extracted op as the guide's step "import it in ops/__init__.py" would
    have it (``fuseinfer.ops.scale_add``): every test that is not marked ``gpu``, on the CPU."""
    import fuseinfer.ops

    monkeypatch.setattr(fuseinfer.ops, "scale_add", toy_op.scale_add, raising=False)
    monkeypatch.setattr(fuseinfer.ops, "scale_add_ref", toy_op.scale_add_ref, raising=False)
    (tmp_path / "test_scale_add_guide.py").write_text(
        _code_block_after(GUIDE.read_text(), "`tests/ops/test_scale_add.py`:", "python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    tests = importlib.import_module("test_scale_add_guide")
    ran = []
    for name, fn in inspect.getmembers(tests, inspect.isfunction):
        marks = {m.name for m in getattr(fn, "pytestmark", [])}
        if not name.startswith("test_") or "gpu" in marks:
            continue
        fn(*(["cpu"] if "device" in inspect.signature(fn).parameters else []))
        ran.append(name)
    assert {"test_opcheck_cpu", "test_gradients_match_reference"} <= set(ran), ran
    assert len(ran) >= 4, ran


def test_the_toy_op_is_not_shipped():
    """The guide's op is a template: the package does not define it (its test would then test the package's)."""
    assert not (REPO / "fuseinfer" / "ops" / "scale_add.py").exists()


# ---- word budgets

@pytest.mark.parametrize("doc, limit", [("README.md", 2000), ("docs/history.md", 3000), ("docs/design.md", 3000)])
def test_word_budget(doc, limit):
    assert len((REPO / doc).read_text().split()) <= limit
