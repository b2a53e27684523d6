"""The OPT family (facebook/opt-125m ... opt-66b): everything OPT-specific lives in this folder."""
from fuseinfer.models.opt.family import OPTFamily

__all__ = ["OPTFamily"]
