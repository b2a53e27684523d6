"""WikiText-2 (raw) test text, exactly as the GPTQ / SmoothQuant perplexity evaluations see it.

The evaluated string is ``"\\n\\n".join(rows)`` over the rows of the Hugging Face dataset ``wikitext``,
config ``wikitext-2-raw-v1``, split ``test``. Where the rows come from (``--data-dir``, ``$FUSEINFER_DATA_DIR``,
the shared assets folder, then ``datasets``) is decided by :mod:`fuseinfer.core.data`, the resolver every part of
fuseinfer uses; this module gives its answer the eval's error type and tokenizes it.
"""
from __future__ import annotations

import os

import torch

from fuseinfer.core import data as resolver
from fuseinfer.core.errors import FuseInferError
from fuseinfer.harness.errors import EvalError

TEST_FILE = resolver.split_file("test")
DATA_DIR_ENV = resolver.DATA_DIR_ENV
EvalText = resolver.Text  # (the eval's name for it)


def rows_from_file(path: str | os.PathLike) -> list[str]:
    """The dataset rows of a ``wiki.*.raw`` file (:func:`fuseinfer.core.data.rows_from_file`), as :class:`EvalError`."""
    try:
        return resolver.rows_from_file(path)
    except FuseInferError as exc:
        raise EvalError(str(exc)) from None


def load_eval_text(data_dir: str | None) -> EvalText:
    """The joined WikiText-2 test text, found by :func:`fuseinfer.core.data.load_text` (``data_dir``: ``--data-dir``)."""
    try:
        return resolver.load_text("test", data_dir)
    except FuseInferError as exc:
        raise EvalError(str(exc)) from None


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text, tokenized once as GPTQ does (with the tokenizer's BOS): (1, N) int64."""
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids
