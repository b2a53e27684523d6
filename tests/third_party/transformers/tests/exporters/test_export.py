"""Stand-in for transformers' ``tests/exporters/test_export.py``, which its source distribution does not ship: an
empty ``ExportTesterMixin``, so ``test_modeling_common`` imports unchanged. Its torch.export tests do not run here
(fuseinfer's own export tests cover exporting patched models)."""


class ExportTesterMixin:
    pass
