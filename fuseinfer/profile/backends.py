"""Which backend to profile and what one step of each phase is.

Backends are the eval's, found where they are defined (:data:`BACKENDS`: the plain ones of
``fuseinfer.harness.backends`` and the feature packages' ``backends.py``), resolved by name when a profile starts.
``fuseinfer-<quant>`` names not listed there are built from ``fuseinfer.PatchConfig(quant=...)`` where fuseinfer
has that config (``QUANT_CONFIGS``). A step is the eval's timed step: ``prefill`` is ``backend.prefill(prompt)``,
``decode`` one ``backend.decode_step``, ``generate`` a prefill and ``gen_len`` decode steps (the eval's
``_generate``).
"""
from __future__ import annotations

import torch

from fuseinfer.export.backends import BACKENDS as EXPORT_BACKENDS
from fuseinfer.harness.backends import Backend, CompileBackend, EagerBackend, FuseInferBackend
from fuseinfer.profile.errors import ProfileError
from fuseinfer.quant.backends import BACKENDS as QUANT_BACKENDS

# the backends the profiler runs, by name (the eval CLI's, less the tensor-parallel wrapping)
BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (EagerBackend, CompileBackend, FuseInferBackend,
                                                                  *QUANT_BACKENDS, *EXPORT_BACKENDS)}
PHASES = ("prefill", "decode", "generate")
# fuseinfer-<suffix> -> the name of the fuseinfer config class that PatchConfig(quant=...) takes
QUANT_CONFIGS = {"w8a16": "Int8WeightOnly", "w8a8": "SmoothQuantW8A8"}


def available_backends() -> list[str]:
    return list(BACKENDS) + [f"fuseinfer-{q}" for q in QUANT_CONFIGS if f"fuseinfer-{q}" not in BACKENDS]


def resolve_backend(name: str) -> type[Backend]:
    """The backend class for ``name``; raises :class:`ProfileError` for an unknown or uninstalled one."""
    if name in BACKENDS:
        return BACKENDS[name]
    suffix = name.removeprefix("fuseinfer-")
    if name.startswith("fuseinfer-") and suffix in QUANT_CONFIGS:
        import fuseinfer

        config_cls = getattr(fuseinfer, QUANT_CONFIGS[suffix], None)
        fields = getattr(fuseinfer.PatchConfig, "__dataclass_fields__", {})
        if config_cls is None or "quant" not in fields:
            raise ProfileError(f"backend {name!r} is not installed: this fuseinfer has no "
                               f"fuseinfer.{QUANT_CONFIGS[suffix]} / PatchConfig(quant=...) (the int8 feature); "
                               f"choose from {', '.join(BACKENDS)}")

        class QuantBackend(FuseInferBackend):
            summary = f"fuseinfer.patch(model, PatchConfig(quant={QUANT_CONFIGS[suffix]}()))"

            def prepare(self):
                self.report = fuseinfer.patch(self.model, fuseinfer.PatchConfig(quant=config_cls()))
                self.decode = "not run"

        QuantBackend.name = name
        return QuantBackend
    raise ProfileError(f"unknown backend {name!r}: choose from {', '.join(available_backends())}")


def has_phase(backend_cls: type[Backend], phase: str) -> bool:
    """Whether the backend implements the methods ``phase`` calls (a backend that only scores perplexity, say,
    keeps the interface's ``NotImplementedError`` stubs)."""
    needs = {"prefill": ("prefill",), "decode": ("prefill", "decode_step"),
             "generate": ("prefill", "decode_step")}[phase]
    return all(getattr(backend_cls, m) is not getattr(Backend, m) for m in needs)


def uses_graphs(backend: Backend) -> bool:
    """Whether the backend's decode step replays CUDA graphs (fuseinfer's session, compile's reduce-overhead)."""
    session = getattr(backend, "session", None)
    return bool(getattr(session, "graphs", None)) or (backend.name == "compile" and backend.device.type == "cuda")


def module_backend(model: torch.nn.Module, name: str | None = None) -> type[Backend]:
    """A backend class around a model the caller already has (profile(model=<nn.Module>)): the fuseinfer backend's
    steps when it is patched by fuseinfer, else the eager one's; ``close`` leaves the model as it is."""
    import fuseinfer

    patched = fuseinfer.patch_state(model) is not None
    base = FuseInferBackend if patched else EagerBackend

    class ModelBackend(base):
        summary = f"the given {type(model).__name__}" + (" (patched by fuseinfer)" if patched else "")

        def load(self):
            from fuseinfer.harness.models import model_stats

            self.model = model
            self.stats = model_stats(model)
            if patched:
                self.report = fuseinfer.patch_report(model)
                self.decode = "not run"

        def close(self):
            self.end()
            self.model = None

    ModelBackend.name = name or ("fuseinfer" if patched else "eager")
    return ModelBackend


def step_function(backend: Backend, phase: str, prompt: torch.Tensor, gen_len: int):
    """(prepare, step): ``prepare()`` gets the backend's state ready for the steps (a prefill before decode steps),
    ``step()`` runs one step of ``phase``."""
    state = {}

    if phase == "prefill":
        return (lambda: None), (lambda: backend.prefill(prompt))
    if phase == "decode":
        def prepare():
            state["tokens"] = backend.prefill(prompt)

        def step():
            state["tokens"] = backend.decode_step(state["tokens"])
        return prepare, step

    def generate():
        tokens = backend.prefill(prompt)
        for _ in range(gen_len):
            tokens = backend.decode_step(tokens)
    return (lambda: None), generate
