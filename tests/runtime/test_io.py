"""selfspec.runtime.io: atomic files and directories, including a writer killed with SIGKILL half-way."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from selfspec.runtime.io import (
    MARKER,
    atomic_directory,
    atomic_write_bytes,
    atomic_write_text,
    file_lock,
    is_complete,
    remove_stale_temporaries,
)


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_atomic_directory_writes_marker_and_lists_files(tmp_path):
    final = tmp_path / "heads"
    with atomic_directory(final) as tmp:
        assert tmp.parent == final.parent and tmp != final
        (tmp / "a.txt").write_text("hello")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"\0" * 10)
        assert not final.exists()  # nothing visible before the block ends
    assert (final / "a.txt").read_text() == "hello"
    assert is_complete(final) and is_complete(final, check_sizes=True)
    assert (final / MARKER).is_file()
    assert _siblings(final) == []  # no temporaries left behind


def test_atomic_directory_replaces_old_version(tmp_path):
    final = tmp_path / "d"
    with atomic_directory(final) as tmp:
        (tmp / "v").write_text("1")
    with atomic_directory(final) as tmp:
        (tmp / "v").write_text("2")
    assert (final / "v").read_text() == "2" and is_complete(final)
    assert _siblings(final) == []


def test_exception_keeps_old_directory_and_removes_temporary(tmp_path):
    final = tmp_path / "d"
    with atomic_directory(final) as tmp:
        (tmp / "v").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(final) as tmp:
            (tmp / "v").write_text("new, half written")
            raise RuntimeError("boom")
    assert (final / "v").read_text() == "old" and is_complete(final)
    assert _siblings(final) == []


def test_exception_on_first_write_leaves_nothing(tmp_path):
    final = tmp_path / "d"
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(final) as tmp:
            (tmp / "v").write_text("x")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_sigkill_mid_write_leaves_no_complete_directory_and_next_write_cleans_up(tmp_path):
    final = tmp_path / "d"
    script = textwrap.dedent(f"""
        import os, signal
        from selfspec.runtime.io import atomic_directory
        with atomic_directory({str(final)!r}) as tmp:
            (tmp / "weights.bin").write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert result.returncode == -signal.SIGKILL
    assert not final.exists()
    [leftover] = [p for p in tmp_path.iterdir()]
    assert leftover.name.startswith(".d.tmp-") and not is_complete(leftover)
    with atomic_directory(final) as tmp:  # the dead writer's temporary is removed by the next writer
        (tmp / "weights.bin").write_bytes(b"y")
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and is_complete(final)


def test_killed_between_renames_restores_previous_version(tmp_path):
    final = tmp_path / "d"
    with atomic_directory(final) as tmp:
        (tmp / "v").write_text("old")
    # What a writer killed after moving the old copy aside (and before moving its own in) leaves behind.
    dead_pid = _dead_pid()
    moved = tmp_path / f".d.old-{socket.gethostname()}-{dead_pid}-abcd1234"
    os.replace(final, moved)
    remove_stale_temporaries(final)
    assert (final / "v").read_text() == "old" and is_complete(final)


def test_is_complete_rejects_missing_marker_truncation_and_garbage(tmp_path):
    final = tmp_path / "d"
    with atomic_directory(final) as tmp:
        (tmp / "w").write_bytes(b"1234")
    (final / "w").write_bytes(b"12")
    assert is_complete(final) and not is_complete(final, check_sizes=True)
    (final / MARKER).write_text("not json")
    assert not is_complete(final)
    (final / MARKER).unlink()
    assert not is_complete(final)
    assert not is_complete(tmp_path / "missing")


def test_atomic_write_text_and_bytes(tmp_path):
    path = tmp_path / "f.json"
    atomic_write_text(path, "one")
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_atomic_write_gives_the_mode_a_plain_open_gives(tmp_path):
    """mkstemp's temporaries are 0600: a saved drafter must not end up unreadable to the group and others."""
    mask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "weights.bin", b"x")
        (tmp_path / "plain.bin").write_bytes(b"x")
        assert (tmp_path / "weights.bin").stat().st_mode & 0o777 == (tmp_path / "plain.bin").stat().st_mode & 0o777
        assert (tmp_path / "weights.bin").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f"
    atomic_write_text(path, "old")

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_file_lock_excludes_a_second_process(tmp_path):
    lock = tmp_path / "x.lock"
    probe = textwrap.dedent(f"""
        import fcntl, sys
        with open({str(lock)!r}, "a") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                sys.exit(3)
    """)
    with file_lock(lock):
        assert subprocess.run([sys.executable, "-c", probe]).returncode == 3
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# A writer replacing an existing directory, SIGKILLed right after its Nth filesystem step of the move (the Nth
# os.replace, or the atomic exchange): what a reader finds afterwards must be the old or the new directory, whole.
KILL_AFTER_STEP = """
import os, signal, sys
import selfspec.runtime.io as io
step, mode, final = int(sys.argv[1]), sys.argv[2], sys.argv[3]
calls = []
def counted(fn):
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    return wrapped
io.os.replace = counted(os.replace)
io._exchange = counted(io._exchange) if mode == "exchange" else (lambda a, b: False)
with io.atomic_directory(final) as tmp:
    (tmp / "v").write_text("new")
"""


@pytest.mark.parametrize("mode", ["exchange", "two-renames"])
@pytest.mark.parametrize("step", [1, 2])
def test_replacing_a_directory_keeps_the_old_or_the_new_one_when_killed_at_any_step(tmp_path, mode, step):
    from selfspec.runtime.io import _exchange, verify_directory

    final = tmp_path / "d"
    with atomic_directory(final) as tmp:
        (tmp / "v").write_text("old")
    probe_a, probe_b = tmp_path / "pa", tmp_path / "pb"
    probe_a.mkdir(), probe_b.mkdir()
    if mode == "exchange" and not _exchange(probe_a, probe_b):
        pytest.skip("this filesystem cannot exchange two paths atomically (the two-renames mode covers it)")
    result = subprocess.run([sys.executable, "-c", KILL_AFTER_STEP, str(step), mode, str(final)], capture_output=True)
    killed = result.returncode == -signal.SIGKILL
    assert killed or (mode == "exchange" and step == 2 and result.returncode == 0), result.stderr[-2000:]
    verify_directory(final, "heads")  # a reader puts a moved-aside previous version back if it must
    assert (final / "v").read_text() in ("old", "new")
    if mode == "two-renames" and step == 1:
        assert (final / "v").read_text() == "old"  # killed with the old copy moved aside: restored
    with atomic_directory(final) as tmp:  # the next writer cleans up whatever the dead one left
        (tmp / "v").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "pa", "pb"] and (final / "v").read_text() == "newer"


def test_verify_directory_names_the_damaged_file(tmp_path):
    from selfspec.runtime.io import DamagedDirectoryError, load_verified_weights, verify_directory

    final = tmp_path / "d"
    with atomic_directory(final) as tmp:
        (tmp / "a.bin").write_bytes(b"1234")
        (tmp / "b.bin").write_bytes(b"5678")
        (tmp / "README.md").write_text("# card")
    verify_directory(final)
    (final / "README.md").write_text("# card, edited by its owner")  # documentation: editing it breaks nothing
    verify_directory(final)
    (final / "b.bin").write_bytes(b"5679")  # same size, other content
    with pytest.raises(DamagedDirectoryError, match="b.bin does not have the content that was written"):
        verify_directory(final)
    (final / "b.bin").write_bytes(b"56")
    with pytest.raises(DamagedDirectoryError, match="b.bin has 2 bytes, 4 were written"):
        verify_directory(final)
    (final / "b.bin").unlink()
    with pytest.raises(DamagedDirectoryError, match="b.bin is missing"):
        verify_directory(final)
    (final / MARKER).unlink()
    with pytest.raises(DamagedDirectoryError, match="completion marker"):
        verify_directory(final)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        verify_directory(tmp_path / "nothing")

    import torch
    from safetensors.torch import save_file
    with atomic_directory(tmp_path / "w") as tmp:
        save_file({"ok": torch.ones(3), "bad": torch.tensor([1.0, float("nan")])}, str(tmp / "model.safetensors"))
    with pytest.raises(DamagedDirectoryError, match="tensor 'bad' of model.safetensors holds NaN"):
        load_verified_weights(tmp_path / "w", "heads")


def test_stored_float_dtype_reads_the_header(tmp_path):
    import torch
    from safetensors.torch import save_file

    from selfspec.runtime.io import stored_float_dtype

    cases = [({"w": torch.zeros(2, dtype=torch.float16), "ids": torch.arange(3)}, torch.float16),
             ({"w": torch.zeros(2, dtype=torch.bfloat16)}, torch.bfloat16),
             ({"w": torch.zeros(2), "ids": torch.arange(3)}, None),  # float32: the default, nothing to ask for
             ({"w": torch.zeros(2), "h": torch.zeros(2, dtype=torch.float16)}, None)]  # mixed: no single dtype to ask for
    for i, (tensors, expected) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        save_file(tensors, str(tmp_path / str(i) / "model.safetensors"))
        assert stored_float_dtype(tmp_path / str(i)) == expected
