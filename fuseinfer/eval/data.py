"""WikiText-2 (raw) test text, exactly as the GPTQ / SmoothQuant perplexity evaluations see it.

The evaluated string is ``"\\n\\n".join(rows)`` over the rows of the Hugging Face dataset ``wikitext``,
config ``wikitext-2-raw-v1``, split ``test``. Those rows are rebuilt from ``wiki.test.raw`` when a data directory
is given (``--data-dir`` or ``FUSEINFER_DATA_DIR``), else read through ``datasets`` when it is installed and can
reach the dataset (hub or cache).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import knobs
from .errors import EvalError

TEST_FILE = "wiki.test.raw"
DATA_DIR_ENV = "FUSEINFER_DATA_DIR"


@dataclass(frozen=True)
class EvalText:
    """The text to score and where it came from."""

    text: str
    source: str
    rows: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def rows_from_file(path: str | os.PathLike) -> list[str]:
    """The dataset rows of a ``wiki.*.raw`` file: one per line, keeping its ``\\n``; blank lines become ``""``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read {path} as UTF-8 text ({exc}): pass --data-dir a folder with the WikiText-2 "
                        "raw files as published") from None
    return [line if line.strip() else "" for line in text.splitlines(keepends=True)]


def _rows_from_datasets() -> list[str] | None:
    """The test rows through ``datasets``, or None when it is not installed or cannot reach the dataset."""
    if importlib.util.find_spec("datasets") is None:
        return None
    import datasets

    try:
        return list(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"])
    except Exception:  # offline without a cached copy, hub errors: fall through to the missing-data message
        return None


def load_eval_text(data_dir: str | None) -> EvalText:
    """The joined WikiText-2 test text; ``data_dir`` (or $FUSEINFER_DATA_DIR) wins over ``datasets``."""
    data_dir = data_dir or knobs.get(DATA_DIR_ENV)
    if data_dir:
        path = Path(data_dir).expanduser() / TEST_FILE
        if not path.is_file():
            raise EvalError(f"{path} not found: pass --data-dir (or set ${DATA_DIR_ENV}) to a folder with "
                            f"{TEST_FILE}")
        rows, source = rows_from_file(path), str(path.resolve())
    else:
        rows, source = _rows_from_datasets(), "datasets: wikitext/wikitext-2-raw-v1 test"
        if rows is None:
            raise EvalError(f"no WikiText-2 data: pass --data-dir pointing at a folder with {TEST_FILE} "
                            f"(or set {DATA_DIR_ENV}), or install datasets")
    return EvalText(text="\n\n".join(rows), source=source, rows=len(rows))


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text, tokenized once as GPTQ does (with the tokenizer's BOS): (1, N) int64."""
    return tokenizer(text, return_tensors="pt", verbose=False).input_ids
