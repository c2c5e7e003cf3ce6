"""Crash-safe writes: a file or a whole directory appears complete at its final path, or not at all.

Converted models, Medusa / early-exit heads and checkpoints are all written through ``atomic_directory``: the
content goes into a temporary sibling, a completion marker is written last, everything is fsynced, and one
rename puts it in place. A process killed half-way leaves only a temporary directory (no marker, never at the
final path); ``is_complete`` is how readers tell a finished directory from a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the files of every saved draft module (heads, classifiers, skip sets) and converted model
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
README_NAME = "README.md"
CALIBRATION_NAME = "calibration.json"  # how calibration chose a directory's default drafting
MARKER = ".selfspec-complete"
_TMP_INFIX = ".tmp-"
_OLD_INFIX = ".old-"


def cache_home() -> Path:
    """``$SELFSPEC_HOME``, or ``~/.cache/selfspec``: converted models, built kernels, downloaded wheels."""
    return Path(os.environ.get("SELFSPEC_HOME") or Path.home() / ".cache" / "selfspec").expanduser()


def is_complete(directory: str | os.PathLike, *, check_sizes: bool = False) -> bool:
    """Whether ``directory`` was finished by ``atomic_directory`` (its marker exists).

    With ``check_sizes``, every file the marker lists must also still have its recorded size, so a later
    truncation or deletion is noticed (only for directories that are never updated in place, like a model cache).
    """
    marker = Path(directory) / MARKER
    try:
        sizes = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not check_sizes:
        return True
    for name, size in sizes.items():
        try:
            if (Path(directory) / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old content or the new, never a partial file.

    Raises:
        OSError: the directory is missing or not writable.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{_TMP_INFIX}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """``atomic_write_bytes`` for text.

    Raises:
        OSError: the directory is missing or not writable.
    """
    return atomic_write_bytes(path, text.encode(encoding))


@contextmanager
def atomic_directory(final_path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it to ``final_path`` only once the block succeeds.

    On success the marker (listing every file and its size) is written last, all files are fsynced, and the
    directory is renamed into place, replacing an existing one (the old one is moved aside first and then
    deleted, because a rename cannot replace a non-empty directory). If the block raises, the temporary
    directory is removed and whatever was at ``final_path`` is left untouched. Temporaries left by processes
    that died (SIGKILL, power loss) on this host are removed the next time the same path is written. Readers
    are always safe; two processes writing the same path at once should serialise with ``file_lock``.

    Raises:
        OSError: the parent directory cannot be created or written.
    """
    final_path = Path(final_path)
    final_path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final_path)
    tmp = final_path.parent / f".{final_path.name}{_TMP_INFIX}{_owner_tag()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _write_marker(tmp)
        _fsync_tree(tmp)
        _move_into_place(tmp, final_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temporaries(final_path: str | os.PathLike) -> list[Path]:
    """Clean up after writers of ``final_path`` that died on this host; return the paths removed.

    Their temporaries are deleted. A previous version that was moved aside by a writer killed between its two
    renames is put back if nothing is at ``final_path``, so a crash never loses the last complete copy.
    """
    final_path = Path(final_path)
    removed: list[Path] = []
    if not final_path.parent.is_dir():
        return removed
    host = socket.gethostname()
    for candidate in sorted(final_path.parent.iterdir()):
        for infix in (_TMP_INFIX, _OLD_INFIX):
            prefix = f".{final_path.name}{infix}{host}-"
            if not candidate.name.startswith(prefix):
                continue
            pid_text = candidate.name[len(prefix):].split("-", 1)[0]
            if not pid_text.isdigit() or _pid_alive(int(pid_text)):
                continue
            if infix == _OLD_INFIX and not final_path.exists():
                os.replace(candidate, final_path)
            else:
                shutil.rmtree(candidate, ignore_errors=True)
                removed.append(candidate)
    return removed


@contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed) for the block, waiting for other holders.

    Writers of one ``atomic_directory`` path take it so that two processes never build the same thing at once:
    the second waits, then finds the first one's result. Where ``fcntl`` is unavailable it does not lock.

    Raises:
        OSError: the lock file cannot be created.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: atomic renames still keep readers safe, only duplicate work is possible
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _owner_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _write_marker(directory: Path) -> None:
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MARKER
    }
    with open(directory / MARKER, "w") as f:
        json.dump({"files": files}, f, indent=1)


def _fsync_tree(directory: Path) -> None:
    # Without this a crash after the rename could leave the final path with empty or partial files:
    # the rename can reach the disk before the data does.
    for p in directory.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        _fsync_dir(d)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, final_path: Path) -> None:
    old = None
    if final_path.exists() or final_path.is_symlink():
        old = final_path.parent / f".{final_path.name}{_OLD_INFIX}{_owner_tag()}-{uuid.uuid4().hex[:8]}"
        os.replace(final_path, old)
    try:
        os.replace(tmp, final_path)
    except OSError:
        if old is not None and not final_path.exists():
            os.replace(old, final_path)  # put the previous version back rather than leave nothing
        raise
    _fsync_dir(final_path.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
