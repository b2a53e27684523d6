"""Model families fuseinfer can patch, by ``config.model_type``. A new family is one more module here."""
from .opt import OPTFamily

FAMILIES = {"opt": OPTFamily()}
