"""The ``compile`` backend: torch.compile with a static KV cache (:class:`fuseinfer.harness.backends.CompileBackend`)."""
from fuseinfer.eval.backends import register
from fuseinfer.harness.backends import CompileBackend

register(CompileBackend)
