"""transformers' common model tests on the Mistral classes: the Llama module's tester and checks (see
``tests/models/llama/test_llama_common.py``) with Mistral's config and model classes. The tester's Mistral has no
sliding window (``sliding_window=None``): fuseinfer refuses a window shorter than the context by design."""

from transformers import (
    MistralConfig,
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
)
from transformers.testing_utils import require_torch

from ..llama import test_llama_common as llama  # (a module: its test class is not collected again here)


class MistralModelTester(llama.LlamaModelTester):
    """A 2-layer grouped-query Mistral (4 heads, 2 KV heads), attending over the whole context."""

    config_class = MistralConfig
    config_kwargs = {"sliding_window": None}


@require_torch
class MistralCommonTest(llama.LlamaCommonTest):
    all_model_classes = (MistralModel, MistralForCausalLM, MistralForSequenceClassification,
                         MistralForQuestionAnswering, MistralForTokenClassification)
    model_tester_class = MistralModelTester


