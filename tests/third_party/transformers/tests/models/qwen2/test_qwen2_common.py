"""transformers' common model tests on the Qwen2 classes: the Llama module's tester and checks (see
``tests/models/llama/test_llama_common.py``) with Qwen2's config and model classes, whose q / k / v projections have
biases. The tester's Qwen2 has no sliding-window layers (``use_sliding_window=False``): fuseinfer refuses them by
design."""
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
)
from transformers.testing_utils import require_torch

from ..llama import test_llama_common as llama  # (a module: its test class is not collected again here)


class Qwen2ModelTester(llama.LlamaModelTester):
    """A 2-layer grouped-query Qwen2 (4 heads, 2 KV heads; q / k / v biases), attending over the whole context."""

    config_class = Qwen2Config
    config_kwargs = {"use_sliding_window": False}


@require_torch
class Qwen2CommonTest(llama.LlamaCommonTest):
    all_model_classes = (Qwen2Model, Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2ForQuestionAnswering,
                         Qwen2ForTokenClassification)
    model_tester_class = Qwen2ModelTester
