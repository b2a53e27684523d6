"""The one way fuseinfer writes files and folders: atomically, never over what it did not write.

    check_writable(out, folder=True, marker="profile.json", overwrite=args.overwrite)   # before any model loads
    with atomic_dir(out, marker="profile.json", overwrite=True) as tmp:               # fill tmp; it becomes out
        ...
    with atomic_file("results.json", overwrite=False) as tmp:                           # write tmp; it becomes the file
        tmp.write_text(...)
    write_text("results.json", text, overwrite=False)

Rules (the same for every caller):

- A folder is replaced only when it is empty or holds the caller's ``marker`` (the manifest a fuseinfer run writes
  last); anything else is refused with one line naming the fix. The current folder and any folder above it are
  never replaced. A file is replaced only with ``overwrite``.
- Writing goes into a temporary sibling named ``.fuseinfer-tmp-<pid>-<token>-<name>`` (same filesystem, so the final
  rename is atomic). A folder swap: old folder renamed aside (``.fuseinfer-old-...``), new one renamed in, old one
  removed. A file: ``os.replace``.
- The temporary is removed on every exit: exceptions, ``KeyboardInterrupt``, and SIGTERM (turned into an exception
  while a write is in flight, in the main thread). A process killed outright (SIGKILL) leaves its temporary behind;
  the next write beside it removes every ``.fuseinfer-tmp-``/``.fuseinfer-old-`` sibling whose process is gone.

Errors are :class:`~fuseinfer.core.errors.FuseInferError` (each CLI turns it into one ``error:`` line, exit 2).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import threading
from pathlib import Path

from fuseinfer.core.errors import FuseInferError

TMP, OLD = ".fuseinfer-tmp-", ".fuseinfer-old-"
_OWN = re.compile(r"^\.fuseinfer-(?:tmp|old)-(\d+)-[0-9a-f]{8}-(.+)$")


class WriteError(FuseInferError):
    """An output that cannot or must not be written: the message names the path and the fix."""


def _abs(path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(folder: Path) -> str | None:
    """Why nothing can be created in ``folder`` (tried for real: permission bits do not stop root, a read-only
    filesystem stops everyone), or None."""
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        probe = folder / f"{TMP}{os.getpid()}-{secrets.token_hex(4)}-probe"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"the folder {folder} is not writable ({exc.strerror or exc})"
    return None


def _inside_cwd(path: Path) -> bool:
    try:
        cwd = Path(os.getcwd()).resolve()
    except OSError:
        return False
    resolved = path.resolve()
    return cwd == resolved or resolved in cwd.parents


def owned_by_fuseinfer(marker_file: Path) -> bool:
    """Whether ``marker_file`` is a manifest fuseinfer wrote: a JSON object whose ``schema`` names a fuseinfer
    format (``fuseinfer.onnx/2``, ``fuseinfer.profile/1`` ...). A file that merely has the marker's name (a user's
    own ``profile.json``) does not make a folder fuseinfer's to replace."""
    try:
        data = json.loads(marker_file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("schema", "")).startswith("fuseinfer.")


def check_writable(path, *, folder: bool = False, marker: str | None = None, overwrite: bool = False,
                   flag: str = "--out") -> Path:
    """Raise :class:`WriteError` unless ``path`` can be written by :func:`atomic_dir` (``folder``) or
    :func:`atomic_file` with these arguments; nothing is created. Returns the absolute path. Call it before any
    model is loaded."""
    p = _abs(path)
    where = f"{flag} {path}"
    if folder:
        if p.exists() and not p.is_dir():
            raise WriteError(f"cannot write {where}: it is a file, not a folder; choose another {flag}")
        try:
            holds = p.is_dir() and any(p.iterdir())
        except OSError as exc:
            raise WriteError(f"cannot write {where}: {exc.strerror or exc}; choose another {flag}") from None
        if holds:
            owned = marker is not None and owned_by_fuseinfer(p / marker)
            if not owned:
                raise WriteError(f"cannot write {where}: the folder holds files fuseinfer did not write (no "
                                 f"{marker or 'manifest'} of fuseinfer's), which it never replaces; choose another "
                                 f"{flag}")
            if not overwrite:
                raise WriteError(f"cannot write {where}: it holds earlier results; pass --overwrite to replace "
                                 f"them, or choose another {flag}")
        if p.exists() and _inside_cwd(p):
            raise WriteError(f"cannot write {where}: it is the current folder or holds it; choose another {flag}")
    else:
        if p.is_dir():
            raise WriteError(f"cannot write {where}: it is a folder; choose another path, naming a file")
        if p.exists() and not overwrite:
            raise WriteError(f"cannot write {where}: the file exists; pass --overwrite to replace it, or choose "
                             "another path")
    problem = _probe(_nearest_existing(p.parent))
    if problem:
        raise WriteError(f"cannot write {where}: {problem}; choose another path")
    return p


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale(final: Path) -> list[Path]:
    """Remove the temporaries a killed fuseinfer process left beside ``final`` (recognised by name and a process id
    that no longer runs); returns what was removed."""
    removed = []
    parent = final.parent
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        m = _OWN.match(entry.name)
        if m and m.group(2) == final.name and not _pid_alive(int(m.group(1))):
            if entry.name.startswith(OLD) and not final.exists():
                entry.rename(final)  # killed between its two renames: the earlier results go back, never lost
                continue
            _remove(entry)
            removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _sibling(final: Path, kind: str) -> Path:
    return final.with_name(f"{kind}{os.getpid()}-{secrets.token_hex(4)}-{final.name}")


class _Terminated(BaseException):
    """SIGTERM during a write: unwinds like KeyboardInterrupt so the temporary is removed."""


_swapping = threading.local()  # .pending: a SIGTERM that arrived between a swap's two renames (see _swap)


@contextlib.contextmanager
def _cleanup_on_signal():
    """Turn SIGTERM into an exception while a write is in flight (main thread only: Python allows handlers
    nowhere else); the previous handler comes back after, and a SIGTERM received is re-raised as exit 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if getattr(_swapping, "active", False):  # never between the two renames of a swap: after them
            _swapping.pending = True
            return
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def atomic_dir(path, *, marker: str, overwrite: bool = False, flag: str = "--out"):
    """Yield a fresh temporary folder beside ``path``; when the block ends normally and the folder holds
    ``marker``, it replaces ``path`` (see the module docstring); otherwise it is removed and ``path`` is untouched."""
    final = check_writable(path, folder=True, marker=marker, overwrite=overwrite, flag=flag)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final)
    tmp = _sibling(final, TMP)
    with _cleanup_on_signal():
        try:
            tmp.mkdir()
            yield tmp
            if not (tmp / marker).is_file():
                raise WriteError(f"{final}: the write ended without its {marker}; nothing was replaced")
            # checked again: the folder may have changed while the caller filled tmp
            check_writable(final, folder=True, marker=marker, overwrite=overwrite, flag=flag)
            old = _swap(tmp, final, flag)
            if old is not None:
                _remove(old)
        finally:
            _remove(tmp)


def _swap(tmp: Path, final: Path, flag: str) -> Path | None:
    """Rename ``final`` aside (returned, for the caller to remove) and ``tmp`` into its place; a SIGTERM in between
    waits until both are done, and a failed rename puts the earlier folder back (one WriteError line)."""
    old = _sibling(final, OLD) if final.exists() else None
    _swapping.active, _swapping.pending = True, False
    try:
        if old is not None:
            final.rename(old)
        tmp.rename(final)
    except OSError as exc:
        if old is not None and old.exists() and not final.exists():
            old.rename(final)
        raise WriteError(f"cannot write {flag} {final}: {exc.strerror or exc}; nothing was replaced") from None
    finally:
        _swapping.active = False
    if _swapping.pending:
        _swapping.pending = False
        if old is not None:
            _remove(old)
        raise _Terminated()
    return old


@contextlib.contextmanager
def atomic_file(path, *, overwrite: bool = False, flag: str = "--output"):
    """Yield a temporary path beside ``path`` (same suffix, so format-by-suffix writers work) to write; when the
    block ends normally it replaces ``path`` with ``os.replace``; otherwise it is removed."""
    final = check_writable(path, overwrite=overwrite, flag=flag)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final)
    tmp = _sibling(final, TMP)
    with _cleanup_on_signal():
        try:
            yield tmp
            if not tmp.is_file():
                raise WriteError(f"{final}: the write ended without a file; nothing was replaced")
            if final.is_dir():
                raise WriteError(f"cannot write {flag} {final}: it became a folder; choose another path")
            try:
                os.replace(tmp, final)
            except OSError as exc:
                raise WriteError(f"cannot write {flag} {final}: {exc.strerror or exc}; nothing was replaced") from None
        finally:
            _remove(tmp)


def write_text(path, text: str, *, overwrite: bool = False, flag: str = "--output") -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the absolute path."""
    with atomic_file(path, overwrite=overwrite, flag=flag) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return _abs(path)


def write_bytes(path, data: bytes, *, overwrite: bool = False, flag: str = "--out") -> Path:
    """Write ``data`` to ``path`` atomically; returns the absolute path."""
    with atomic_file(path, overwrite=overwrite, flag=flag) as tmp:
        tmp.write_bytes(data)
    return _abs(path)


def confined(folder, relative: str) -> Path:
    """``folder / relative`` when it stays inside ``folder`` (relative, no ``..``, no symlink out); raises
    :class:`WriteError` otherwise. For paths read from a manifest."""
    folder = Path(folder)
    rel = Path(relative)
    if not relative or rel.is_absolute() or ".." in rel.parts or "\x00" in relative:
        raise WriteError(f"{relative!r} is not a plain relative path inside {folder}")
    resolved = (folder / rel).resolve()
    root = folder.resolve()
    if resolved != root and root not in resolved.parents:
        raise WriteError(f"{relative!r} leads outside {folder} (a symlink)")
    return folder / rel
