"""The package's structure: packages stacked by layer, each importing only downward (lazy imports and imports of
a package's own ``__init__`` included); no import cycle; the eval CLI imported by nobody below it; model-family
names only under fuseinfer/models/; one owner of every FUSEINFER_* knob and the generated knobs table current."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from fuseinfer.core import knobs

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "fuseinfer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """fuseinfer modules ``name`` imports anywhere in its file (top level or inside functions): an imported name
    that is a submodule counts as that submodule, else its package."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t.startswith("fuseinfer") and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_the_package():
    modules = _modules()
    # a package's __init__ re-exporting its submodules is not a cycle with them: edges from a package's submodules
    # to the package itself (``from .. import knobs`` names the module knobs, not fuseinfer/__init__) are dropped
    graph = {m: {t for t in _imports(m, p, modules) if not m.startswith(t + ".")} for m, p in modules.items()}
    assert _cycles(graph) == []


# the layers, bottom first: a module may import its own layer and those below
LAYERS = (
    ("core", ("fuseinfer.core",)),
    ("ops", ("fuseinfer.ops",)),
    ("layers", ("fuseinfer.layers",)),
    ("models", ("fuseinfer.models",)),
    ("runtime", ("fuseinfer.runtime",)),
    ("engine", ("fuseinfer.patching",)),
    ("harness", ("fuseinfer.harness",)),
    ("features", ("fuseinfer.quant", "fuseinfer.export", "fuseinfer.parallel", "fuseinfer.profile")),
    ("api", ("fuseinfer",)),  # the package's __init__: the public names, over everything below
    ("cli", ("fuseinfer.eval",)),
)
MAX_UPWARD = 4  # imports from a lower layer to a higher one, each listed in the failure message


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def _all_edges() -> list[tuple[str, str]]:
    modules = _modules()
    return sorted((m, t) for m, p in modules.items() for t in _imports(m, p, modules))


def test_every_module_has_a_layer():
    for m in _modules():
        _layer(m)


def test_layers_import_downward():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) -> {t} ({LAYERS[_layer(t)][0]})"
              for m, t in _all_edges() if _layer(t) > _layer(m)]
    assert len(upward) <= MAX_UPWARD, "imports running up the layers:\n" + "\n".join(upward)


def test_module_graph_is_acyclic_including_package_inits():
    """Every import counts here, ``from fuseinfer import __version__`` (the package's __init__) included."""
    graph: dict[str, set[str]] = {}
    for m, t in _all_edges():
        graph.setdefault(m, set()).add(t)
    # a package __init__ re-exporting its own submodules is the one allowed shape: drop package -> own submodule
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    assert _cycles(graph) == []


def test_nothing_below_the_cli_imports_eval():
    bad = [f"{m} -> {t}" for m, t in _all_edges()
           if (t == "fuseinfer.eval" or t.startswith("fuseinfer.eval.")) and not m.startswith("fuseinfer.eval")
           and m != "fuseinfer"]
    assert bad == []


FAMILY_WORDS = re.compile(r"fc1|q_proj|OPTDecoderLayer")


def test_family_names_stay_in_the_family_folder():
    """A feature reaches a model through its family (fuseinfer/models/<family>/), never by its module names."""
    hits = [f"{p.relative_to(REPO)}:{i}" for p in PKG.rglob("*.py") if "models" not in p.relative_to(PKG).parts[:1]
            for i, line in enumerate(p.read_text().splitlines(), 1) if FAMILY_WORDS.search(line)]
    assert hits == []


def test_no_family_imports_another():
    """A family owns its model: what families share lives in fuseinfer/models/common.py (or below), never in another
    family's folder."""
    def family(module: str):
        parts = module.split(".")
        return parts[2] if len(parts) > 3 and parts[:2] == ["fuseinfer", "models"] else None

    bad = [f"{m} -> {t}" for m, t in _all_edges() if family(m) and family(t) and family(m) != family(t)]
    assert bad == []


def test_cycle_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_one_module_reads_the_knobs():
    """Only fuseinfer/core/knobs.py reads FUSEINFER_* variables in the package and the extension; every FUSEINFER_*
    name used anywhere in the project is in its table."""
    readers = []
    for p in list(PKG.rglob("*.py")) + list((REPO / "csrc").glob("*")):
        text = p.read_text()
        if p.name != "knobs.py" and re.search(r"(os\.environ|getenv)\W[^\n]*FUSEINFER_", text):
            readers.append(str(p.relative_to(REPO)))
    assert readers == []
    used = set()
    for p in REPO.glob("**/*"):
        if p.is_file() and p.suffix in (".py", ".sh", ".cu", ".cpp", ".h", ".cuh", ".md") and ".venv" not in p.parts \
                and ".git" not in p.parts and "results" not in p.parts and p.name != "notes.md":
            for line in p.read_text(errors="ignore").splitlines():
                if re.search(r"environ|getenv|knobs\.get|\$\{?FUSEINFER_|FUSEINFER_\w+=|^\| `FUSEINFER_", line):
                    used |= set(re.findall(r"\bFUSEINFER_[A-Z0-9_]*[A-Z0-9]\b", line))
    assert used - set(knobs.KNOBS) - knobs.SCRIPT_NAMES == set()


def test_env_doc_is_generated_from_the_table():
    assert (REPO / "docs" / "env.md").read_text() == knobs.markdown()


def test_knob_values_are_checked(monkeypatch):
    import pytest

    from fuseinfer import FuseInferError

    monkeypatch.setenv("FUSEINFER_DECODE_KERNEL", "yes")
    with pytest.raises(FuseInferError, match="FUSEINFER_DECODE_KERNEL must be one of auto, 0, 1"):
        knobs.get("FUSEINFER_DECODE_KERNEL")
    monkeypatch.setenv("FUSEINFER_DECODE_GRAPH_STEPS", "0")
    with pytest.raises(FuseInferError, match="integer >= 1"):
        knobs.get_int("FUSEINFER_DECODE_GRAPH_STEPS")
    with knobs.override(ATTN_SM90="0"):
        assert knobs.extension_values()["FUSEINFER_ATTN_SM90"] == 0
    assert knobs.extension_values()["FUSEINFER_ATTN_SM90"] == 1
