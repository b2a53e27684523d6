"""Where fuseinfer finds WikiText-2 (raw): one resolver for the eval, SmoothQuant calibration and the profiler.

A split (``test`` for perplexity, ``valid`` for calibration) is looked for, in this order:

1. ``data_dir`` -- the caller's ``--data-dir`` (a folder that must hold ``wiki.<split>.raw``);
2. ``$FUSEINFER_DATA_DIR`` (the same; a flag given beside it wins, and the log says so: ``knobs.flag_or_env``);
3. the shared assets folder, ``$FUSEINFER_SHARED/data/wikitext-2-raw`` (``FUSEINFER_SHARED`` defaults to
   ``../shared``, relative to the repository root), when it holds the file;
4. the ``datasets`` library (hub or its cache), when it is installed and can reach the dataset.

Nothing found is one :class:`~fuseinfer.core.errors.FuseInferError` naming ``--data-dir`` / ``FUSEINFER_DATA_DIR``.
The rows of a file are rebuilt as the Hugging Face dataset ``wikitext``/``wikitext-2-raw-v1`` holds them, so the
joined text (``"\\n\\n".join(rows)``) is the same whichever source gave it. This module imports only fuseinfer's
errors and knobs, so that quant/, profile/ and eval/ can all use it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from fuseinfer.core import knobs
from fuseinfer.core.errors import FuseInferError

DATA_DIR_ENV = "FUSEINFER_DATA_DIR"
SPLITS = ("test", "valid")
DATASETS_SPLIT = {"test": "test", "valid": "validation"}
SHARED_DATA = Path("data") / "wikitext-2-raw"
REPO_ROOT = Path(__file__).resolve().parents[2]  # a relative FUSEINFER_SHARED is taken from here


def split_file(split: str) -> str:
    """``wiki.<split>.raw``; an unknown split is an error."""
    if split not in SPLITS:
        raise FuseInferError(f"unknown WikiText-2 split {split!r}: choose from {', '.join(SPLITS)}")
    return f"wiki.{split}.raw"


@dataclass(frozen=True)
class Text:
    """A split's joined text, its rows and where it came from (a resolved file path, or ``datasets: ...``)."""

    text: str
    source: str
    rows: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def shared_dir() -> Path:
    """The shared assets folder: ``$FUSEINFER_SHARED``, a relative value taken from the repository root."""
    shared = Path(knobs.get("FUSEINFER_SHARED")).expanduser()
    return shared if shared.is_absolute() else REPO_ROOT / shared


def rows_from_file(path: str | os.PathLike) -> list[str]:
    """The dataset rows of a ``wiki.*.raw`` file: one per line, keeping its ``\\n``; blank lines become ``""``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FuseInferError(f"cannot read {path} as UTF-8 text ({exc}): pass --data-dir a folder with the "
                             "WikiText-2 raw files as published") from None
    return [line if line.strip() else "" for line in text.splitlines(keepends=True)]


def given_dir(data_dir: str | os.PathLike | None = None) -> tuple[Path, str] | None:
    """(folder, what named it) from ``data_dir`` (``--data-dir``) or ``$FUSEINFER_DATA_DIR``, or None when
    neither is set. A named folder that does not exist is an error naming the flag / variable."""
    if data_dir:
        folder, named = Path(data_dir).expanduser(), "--data-dir"
    elif knobs.get(DATA_DIR_ENV):
        folder, named = Path(knobs.get(DATA_DIR_ENV)).expanduser(), DATA_DIR_ENV
    else:
        return None
    if not folder.is_dir():
        raise FuseInferError(f"{named} {folder} is not a folder: point --data-dir or {DATA_DIR_ENV} at the folder "
                             "with the WikiText-2 raw files (wiki.test.raw, wiki.valid.raw)")
    return folder, named


def find_file(split: str, data_dir: str | os.PathLike | None = None) -> Path | None:
    """The ``wiki.<split>.raw`` file that the order above finds before ``datasets``, or None.

    A folder named by ``--data-dir`` / ``$FUSEINFER_DATA_DIR`` must hold the file (no fallback past an explicit
    choice); the shared folder is used only where it holds it."""
    name = split_file(split)
    given = given_dir(data_dir)
    if given is not None:
        folder, named = given
        if not (folder / name).is_file():
            raise FuseInferError(f"{folder / name} not found (the folder {named} names): point --data-dir or "
                                 f"{DATA_DIR_ENV} at a folder with {name}")
        return folder / name
    shared = shared_dir() / SHARED_DATA / name
    return shared if shared.is_file() else None


def _rows_from_datasets(split: str) -> list[str] | None:
    """The split's rows through ``datasets``, or None when it is not installed or cannot reach the dataset."""
    if importlib.util.find_spec("datasets") is None:
        return None
    import datasets

    try:
        return list(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=DATASETS_SPLIT[split])["text"])
    except Exception:  # offline without a cached copy, hub errors: fall through to the missing-data message
        return None


def load_text(split: str, data_dir: str | os.PathLike | None = None) -> Text:
    """The joined WikiText-2 ``split`` text, from the first source of the order above that has it."""
    path = find_file(split, data_dir)
    if path is not None:
        rows, source = rows_from_file(path), str(path.resolve())
    else:
        rows, source = _rows_from_datasets(split), f"datasets: wikitext/wikitext-2-raw-v1 {DATASETS_SPLIT[split]}"
        if rows is None:
            raise FuseInferError(f"no WikiText-2 data ({split_file(split)}): pass --data-dir (or set "
                                 f"{DATA_DIR_ENV}) to a folder with the WikiText-2 raw files, or install datasets "
                                 "with the dataset reachable")
    return Text(text="\n\n".join(rows), source=source, rows=len(rows))
