"""Stand-in for transformers' ``tests/generation/test_utils.py``, which its source distribution does not ship: an
empty ``GenerationTesterMixin``, so ``test_modeling_common`` imports unchanged. Its ``generate`` tests do not run
from this copy; ``tests/models/llama/test_llama_common.py`` holds a few generation checks of its own (which the Mistral
and Qwen2 modules inherit), and the full upstream modules run where a transformers checkout is given (see the
README)."""


class GenerationTesterMixin:
    pass
