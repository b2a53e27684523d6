"""Generate calls that misuse the runtime: non-integer token ids, and the memory one large call leaves held."""
from __future__ import annotations

import pytest
import torch
from conftest import random_opt

import fuseinfer
from fuseinfer import FuseInferError


@pytest.fixture(scope="module")
def patched():
    model = random_opt()
    fuseinfer.patch(model)
    return model


def _ids(batch=2, length=7):
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.bool,
                                   torch.complex64])
@pytest.mark.parametrize("entry", ["fuseinfer", "model", "model_beams"])
def test_non_integer_input_ids_are_one_clear_error(patched, dtype, entry):
    """transformers refuses float ids deep in the embedding; fast decode used to truncate them (3.7 -> 3)."""
    ids = (_ids().double() + 0.7).to(dtype)
    with pytest.raises(FuseInferError, match="input_ids must hold integer token ids, got dtype"):
        if entry == "fuseinfer":
            fuseinfer.generate(patched, ids, max_new_tokens=3)
        else:
            patched.generate(ids, max_new_tokens=3, do_sample=False, **({"num_beams": 2} if entry == "model_beams"
                                                                        else {}))


def test_int32_input_ids_give_the_int64_result(patched):
    ids = _ids()
    expected = fuseinfer.generate(patched, ids, max_new_tokens=4)
    assert torch.equal(fuseinfer.generate(patched, ids.int(), max_new_tokens=4), expected)
    assert torch.equal(patched.generate(ids.int(), max_new_tokens=4, do_sample=False), expected)
