"""transformers' common model tests (``ModelTesterMixin`` of the vendored ``test_modeling_common``) on the Llama
classes, with a small model tester of our own: transformers' source distribution ships the common tests but not
``tests/models/llama/test_modeling_llama.py``. Written in that module's style so that it runs under the same
harness; a handful of generation and cache checks stand in for ``GenerationTesterMixin``, which is not shipped.

The tester and the test class are written for the whole Llama architecture: the Mistral and Qwen2 modules subclass
them with their own config and model classes (``config_class``, ``config_kwargs``, ``all_model_classes``)."""
import unittest

import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)
from transformers.testing_utils import require_torch, torch_device

from ...generation.test_utils import GenerationTesterMixin
from ...test_modeling_common import ModelTesterMixin, ids_tensor


class LlamaModelTester:
    """Builds the config and inputs the common tests ask for: a 2-layer grouped-query Llama (4 heads, 2 KV heads)."""

    config_class = LlamaConfig
    config_kwargs = {}  # a family's own config settings, on top of the shared ones below

    def __init__(self, parent, batch_size=13, seq_length=7, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=37, is_training=True):
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.is_training = intermediate_size, is_training
        self.num_labels, self.num_choices, self.type_sequence_label_size = 3, 4, 2

    def get_config(self):
        return self.config_class(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                 num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                                 num_key_value_heads=self.num_key_value_heads, intermediate_size=self.intermediate_size,
                                 hidden_act="silu", max_position_embeddings=512, initializer_range=0.02,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2, **self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        # (B, S) token ids and a mask keeping row i's first i + 1 positions (all of them from row S - 1 on)
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones(self.batch_size, self.seq_length, dtype=torch.long)).to(torch_device)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


@require_torch
class LlamaCommonTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    # (base model, causal LM, sequence / question-answering / token heads: the order the checks below index)
    all_model_classes = (LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForQuestionAnswering,
                         LlamaForTokenClassification)
    model_tester_class = LlamaModelTester

    def setUp(self):
        self.model_tester = self.model_tester_class(self)

    def _causal_lm(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        torch.manual_seed(0)
        return self.all_model_classes[1](config).to(torch_device).eval(), inputs

    def test_heads(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.num_labels = 3
        b, s = self.model_tester.batch_size, self.model_tester.seq_length
        for cls, labels, shape in (
            (self.all_model_classes[2], ids_tensor([b], 2), (b, 3)),
            (self.all_model_classes[4], ids_tensor([b, s], 3), (b, s, 3)),
        ):
            model = cls(config).to(torch_device).eval()
            out = model(**inputs, labels=labels)
            self.assertEqual(out.logits.shape, shape)
            self.assertTrue(torch.isfinite(out.loss))

    def test_cache_matches_full_forward(self):
        # the last 3 positions' logits: one forward over everything vs a prefix forward and then the rest on its cache
        model, inputs = self._causal_lm()
        ids = inputs["input_ids"]
        with torch.no_grad():
            full = model(ids).logits[:, -3:]
            cache = DynamicCache(config=model.config)
            model(ids[:, :-3], past_key_values=cache, use_cache=True)
            step = model(ids[:, -3:], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)

    def test_greedy_generate_matches_stepwise_argmax(self):
        # greedy generate (with its cache) against argmax over repeated full forwards
        model, inputs = self._causal_lm()
        ids = inputs["input_ids"][:2]
        # (an explicit mask: random ids may hold the pad token, from which generate would infer right padding)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             min_new_tokens=5, pad_token_id=0)
        # min_new_tokens=5 bans the EOS ids from every step of generate: the stepwise argmax bans them too (a random
        # model's argmax is sometimes an EOS id)
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        seq = ids
        with torch.no_grad():
            for _ in range(5):
                logits = model(seq).logits[:, -1]  # (B, V)
                logits[:, eos] = float("-inf")
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=-1)
        self.assertEqual(out.tolist(), seq.tolist())

    def test_left_padded_generate_matches_unpadded(self):
        # one prompt, alone and left-padded in a batch with a longer one: the same greedy continuation
        model, inputs = self._causal_lm()
        ids = inputs["input_ids"]
        short, long_ = ids[0, 3:].unsqueeze(0), ids[1].unsqueeze(0)
        alone = model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=4, min_new_tokens=4,
                               do_sample=False, pad_token_id=0)
        batch = torch.cat([torch.cat([torch.zeros_like(ids[:1, :3]), short], -1), long_])
        mask = torch.ones_like(batch)
        mask[0, :3] = 0
        both = model.generate(batch, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                              pad_token_id=0)
        self.assertEqual(both[0, -4:].tolist(), alone[0, -4:].tolist())
