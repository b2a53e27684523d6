"""fuseinfer.core.files: atomic file and folder writes, refusal to replace what fuseinfer did not write, cleanup after
exceptions, SIGTERM and kills, writability checked without creating anything, confined manifest paths."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO
from fuseinfer.core import files
from fuseinfer.core.files import WriteError

MARK = "done.json"
OURS = '{"schema": "fuseinfer.test/1"}'  # a marker fuseinfer writes names its format


def _leftovers(folder):
    return [n for n in os.listdir(folder) if n.startswith(".fuseinfer-")]


def test_file_refuses_existing_without_overwrite(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("earlier results")
    with pytest.raises(WriteError, match="exists; pass --overwrite"):
        files.write_text(target, "new")
    assert target.read_text() == "earlier results"
    files.write_text(target, "new", overwrite=True)
    assert target.read_text() == "new" and _leftovers(tmp_path) == []


def test_failed_file_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "r.png"
    target.write_text("old")
    with pytest.raises(RuntimeError), files.atomic_file(target, overwrite=True) as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old" and _leftovers(tmp_path) == []


def test_folder_with_foreign_files_is_never_replaced(tmp_path):
    out = tmp_path / "project"
    out.mkdir()
    (out / "main.py").write_text("source")
    for overwrite in (False, True):
        with pytest.raises(WriteError, match="did not write.*choose another --out"):
            with files.atomic_dir(out, marker=MARK, overwrite=overwrite) as tmp:
                (tmp / MARK).write_text(OURS)
    assert os.listdir(out) == ["main.py"] and _leftovers(tmp_path) == []


def test_folder_written_earlier_needs_overwrite_then_is_swapped(tmp_path):
    out = tmp_path / "out"
    for text in ("one", "two"):
        if text == "two":
            with pytest.raises(WriteError, match="earlier results; pass --overwrite"):
                files.check_writable(out, folder=True, marker=MARK)
        with files.atomic_dir(out, marker=MARK, overwrite=text == "two") as tmp:
            (tmp / MARK).write_text(OURS[:-1] + f', "run": "{text}"}}')
            assert not (out / MARK).exists() or '"one"' in (out / MARK).read_text()  # untouched while writing
    assert '"two"' in (out / MARK).read_text() and sorted(os.listdir(tmp_path)) == ["out"]


def test_empty_folder_is_taken_and_unfinished_write_leaves_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(WriteError, match="without its done.json"), files.atomic_dir(out, marker=MARK) as tmp:
        (tmp / "partial").write_text("x")  # no marker: not finished
    assert os.listdir(out) == [] and _leftovers(tmp_path) == []
    with files.atomic_dir(out, marker=MARK) as tmp:
        (tmp / MARK).write_text(OURS)
    assert os.listdir(out) == [MARK]


def test_current_folder_is_never_replaced(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / MARK).write_text(OURS)
    monkeypatch.chdir(out)
    with pytest.raises(WriteError, match="current folder"):
        files.check_writable(".", folder=True, marker=MARK, overwrite=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WriteError, match="current folder"):  # a folder above the current one neither
        os.chdir(out)
        files.check_writable(tmp_path / "out", folder=True, marker=MARK, overwrite=True)


def _readonly_folder(tmp_path):
    """A folder nothing can be created in, also for root (permission bits do not stop root)."""
    if os.geteuid() == 0:
        return "/sys"
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return str(folder)


def test_unwritable_parent_is_reported_and_nothing_created(tmp_path):
    target = os.path.join(_readonly_folder(tmp_path), "fuseinfer-out")
    for folder in (False, True):
        with pytest.raises(WriteError, match="not writable.*choose another path"):
            files.check_writable(target, folder=folder, marker=MARK)
    assert not os.path.exists(target)


def test_check_writable_creates_nothing(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    files.check_writable(target, folder=True, marker=MARK)
    files.check_writable(target / "r.json")
    assert os.listdir(tmp_path) == []


_WRITER = """
import signal, sys, time
from fuseinfer.core import files
# (a process started in the background of a non-interactive shell inherits SIGINT ignored: restore Python's own)
signal.signal(signal.SIGINT, signal.default_int_handler)
with files.atomic_dir(sys.argv[1], marker="done.json") as tmp:
    (tmp / "big").write_text("x" * 1000)
    print("writing", flush=True)
    time.sleep(60)
    (tmp / "done.json").write_text('{"schema": "fuseinfer.test/1"}')
"""


def _start_writer(out):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "writing"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_write_leaves_no_temporary(tmp_path, sig):
    proc = _start_writer(tmp_path / "out")
    assert len(_leftovers(tmp_path)) == 1  # the temporary exists while writing
    proc.send_signal(sig)
    assert proc.wait(30) != 0
    assert os.listdir(tmp_path) == []


def test_sigkill_leftover_is_removed_by_the_next_write(tmp_path):
    proc = _start_writer(tmp_path / "out")
    proc.kill()
    proc.wait(30)
    assert len(_leftovers(tmp_path)) == 1  # a kill cannot be caught
    (tmp_path / ".fuseinfer-tmp-1-0123abcd-other").mkdir()  # another target's: not ours to remove
    with files.atomic_dir(tmp_path / "out", marker=MARK) as tmp:
        (tmp / MARK).write_text(OURS)
    assert sorted(os.listdir(tmp_path)) == [".fuseinfer-tmp-1-0123abcd-other", "out"]


def test_stale_temporary_of_a_live_process_is_kept(tmp_path):
    live = tmp_path / f".fuseinfer-tmp-{os.getppid()}-0123abcd-out"
    live.mkdir()
    files.remove_stale(tmp_path / "out")
    assert live.exists()


@pytest.mark.parametrize("relative", ["../x", "/etc/passwd", "a/../../b", "", "..", "a/../../../etc"])
def test_confined_refuses_escapes(tmp_path, relative):
    (tmp_path / "export").mkdir()
    with pytest.raises(WriteError):
        files.confined(tmp_path / "export", relative)


def test_confined_refuses_symlink_out(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "secret.onnx").write_text("elsewhere")
    (tmp_path / "export" / "model.onnx").symlink_to(tmp_path / "secret.onnx")
    with pytest.raises(WriteError, match="outside"):
        files.confined(tmp_path / "export", "model.onnx")
    assert files.confined(tmp_path / "export", "sub/model.onnx") == tmp_path / "export" / "sub" / "model.onnx"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "..", ".", "", "/"]), min_size=1, max_size=6))
def test_confined_result_stays_inside(tmp_path_factory, parts):
    root = tmp_path_factory.mktemp("c")
    relative = "/".join(parts)
    try:
        path = files.confined(root, relative)
    except WriteError:
        return
    resolved = path.resolve()
    assert resolved == root.resolve() or root.resolve() in resolved.parents


def test_sigterm_handler_is_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    files.write_text(tmp_path / "x.txt", "x")
    assert signal.getsignal(signal.SIGTERM) is before


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


def test_kill_between_the_swaps_two_renames_loses_nothing(tmp_path):
    """A writer killed after renaming the earlier results aside and before renaming the new ones in leaves only
    the earlier results, under their temporary name: the next write puts them back (and, without --overwrite,
    refuses to replace them) instead of removing them as a leftover."""
    aside = tmp_path / f".fuseinfer-old-{_dead_pid()}-0123abcd-out"
    aside.mkdir()
    (aside / MARK).write_text('{"schema": "fuseinfer.test/1", "earlier": true}')
    with pytest.raises(WriteError, match="earlier results"):
        with files.atomic_dir(tmp_path / "out", marker=MARK) as tmp:
            (tmp / MARK).write_text(OURS)
    assert (tmp_path / "out" / MARK).read_text() == '{"schema": "fuseinfer.test/1", "earlier": true}'
    assert _leftovers(tmp_path) == []


def test_a_failed_rename_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / MARK).write_text('{"schema": "fuseinfer.test/1", "earlier": true}')
    real = type(out).rename

    def rename(self, target):
        if self.name.startswith(files.TMP):  # the new folder cannot move in (e.g. EBUSY on a mount point)
            raise OSError(16, "Device or resource busy")
        return real(self, target)

    monkeypatch.setattr(type(out), "rename", rename)
    with pytest.raises(WriteError, match="busy; nothing was replaced"):
        with files.atomic_dir(out, marker=MARK, overwrite=True) as tmp:
            (tmp / MARK).write_text(OURS)
    assert (out / MARK).read_text() == '{"schema": "fuseinfer.test/1", "earlier": true}'
    assert _leftovers(tmp_path) == []


def test_a_users_file_named_like_the_marker_does_not_make_the_folder_ours(tmp_path):
    """--overwrite replaces a folder only when its marker is a fuseinfer manifest (its schema), not any file of
    that name: a project folder holding its own profile.json is refused, untouched."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "profile.json").write_text('{"name": "my-app", "version": "1.0"}')
    (out / "main.py").write_text("print('hello')")
    with pytest.raises(WriteError, match="did not write"):
        with files.atomic_dir(out, marker="profile.json", overwrite=True) as tmp:
            (tmp / "profile.json").write_text('{"schema": "fuseinfer.profile/1"}')
    assert sorted(os.listdir(out)) == ["main.py", "profile.json"]
