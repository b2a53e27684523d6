"""The eval CLI's shape: every backend registered once, by its own module under ``fuseinfer/eval/backends/``, and
no module outside ``fuseinfer/eval/`` importing the CLI (features and the profiler use ``fuseinfer.harness``)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseinfer.eval import backends as registry
from fuseinfer.eval.runner import Settings, backend_options
from fuseinfer.harness.backends import Backend, BackendOptions

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "fuseinfer"
BACKEND_DIR = PKG / "eval" / "backends"


def test_every_backend_is_registered_by_its_own_module():
    modules = {p.stem for p in BACKEND_DIR.glob("*.py") if p.stem != "__init__"}
    assert registry.BACKENDS and set(registry.BACKENDS) == set(registry.REGISTERED_BY)
    for name, cls in registry.BACKENDS.items():
        assert cls.name == name and issubclass(cls, Backend)
        package, _, module = registry.REGISTERED_BY[name].rpartition(".")
        assert package == "fuseinfer.eval.backends" and module in modules, (name, registry.REGISTERED_BY[name])
    # every module but the --tp wrapping registers something (a module the package does not import registers nothing)
    assert {f"fuseinfer.eval.backends.{m}" for m in modules - {"parallel"}} == set(registry.REGISTERED_BY.values())


def test_each_backend_is_registered_once():
    """One register() per backend across the modules (AST: a second registration would raise at import, a second
    call in another file that is not imported would go unnoticed), and register refuses a name taken."""
    calls = []
    for path in BACKEND_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register":
                calls.append(ast.unparse(node.args[0]))
            elif isinstance(node, ast.ClassDef) and any(getattr(d, "id", None) == "register"
                                                        for d in node.decorator_list):
                calls.append(node.name)
    assert len(calls) == len(set(calls)) == len(registry.BACKENDS)
    taken = next(iter(registry.BACKENDS.values()))
    with pytest.raises(ValueError, match="already registered"):
        registry.register(type("Again", (Backend,), {"name": taken.name}))
    assert registry.BACKENDS[taken.name] is taken


def test_the_profiler_lists_the_eval_backends():
    """The profiler cannot import the eval CLI, so it lists the same classes itself: the two lists stay one."""
    from fuseinfer.profile.backends import BACKENDS as PROFILED

    assert PROFILED == registry.BACKENDS


def _imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Every module ``path`` (under the checkout ``root``) names in an import, top level or inside a function,
    relative ones resolved, and the string given to importlib.import_module / __import__."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1]  # (a package's __init__ resolves relative imports from the package itself)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.add(str(node.args[0].value))
    return out


def _imports_eval(path: Path, root: Path = REPO) -> list[str]:
    return sorted(m for m in _imported_modules(path, root) if m == "fuseinfer.eval" or m.startswith("fuseinfer.eval."))


def test_nothing_outside_eval_imports_it():
    offenders = {str(p.relative_to(REPO)): _imports_eval(p) for p in PKG.rglob("*.py")
                 if (PKG / "eval") not in p.parents and _imports_eval(p)}
    assert offenders == {}


@pytest.mark.parametrize("source, caught", [
    ("import fuseinfer.eval.cli\n", True),
    ("def f():\n    from fuseinfer.eval.runner import run\n", True),
    ("from fuseinfer import eval\n", True),
    ("from .. import eval\n", True),
    ("import importlib\nimportlib.import_module('fuseinfer.eval.backends')\n", True),
    ("from fuseinfer.harness.backends import Backend\nmodel.eval()\n", False),
    ("from fuseinfer.evaluation import x\n", False),
])
def test_the_import_check_sees_lazy_and_relative_imports(tmp_path, source, caught):
    """The check above on sample files placed as fuseinfer/profile/x.py would be."""
    fake = tmp_path / "fuseinfer" / "profile" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    assert bool(_imports_eval(fake, tmp_path)) is caught


@settings(max_examples=30, deadline=None)
@given(onnx_dir=st.none() | st.text(min_size=1, max_size=8), data=st.none() | st.text(min_size=1, max_size=8),
       cal=st.none() | st.text(min_size=1, max_size=8), samples=st.none() | st.integers(1, 10_000))
def test_backend_options_carry_the_settings(onnx_dir, data, cal, samples):
    s = Settings(onnx_dir=onnx_dir, data_dir=data, calibration_data=cal, calibration_samples=samples)
    assert backend_options(s) == BackendOptions(onnx_dir=onnx_dir, calibration_data=cal,
                                                calibration_samples=samples, data_dir=data)


def test_backends_read_no_environment_variable_directly():
    """Backend options come from BackendOptions (or a knob read through fuseinfer.core.knobs), never os.environ."""
    paths = [*BACKEND_DIR.glob("*.py"), PKG / "harness" / "backends.py", PKG / "quant" / "backends.py",
             PKG / "export" / "backends.py", PKG / "eval" / "runner.py"]
    assert [str(p) for p in paths if "os.environ" in p.read_text() or "getenv" in p.read_text()] == []
