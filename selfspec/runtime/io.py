"""Crash-safe writes: a file or a whole directory appears complete at its final path, or not at all.

Converted models, Medusa / early-exit heads and checkpoints are all written through ``atomic_directory``: the
content goes into a temporary sibling, a completion marker is written last, everything is fsynced, and one
rename puts it in place. A process killed half-way leaves only a temporary directory (no marker, never at the
final path); ``is_complete`` is how readers tell a finished directory from a half-written one.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
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


def refresh_card_sections(old: str, new: str, titles: Sequence[str]) -> str:
    """A hand-edited card ``old`` with its ``## TITLE`` sections for ``titles`` replaced by those of a freshly
    rendered card ``new`` (appended where ``old`` lacks them): re-saving a directory (a calibration choosing a new
    default) updates what it changed and keeps what its owner wrote."""

    def split(text: str) -> list[tuple[str | None, str]]:
        parts: list[tuple[str | None, str]] = []
        for chunk in re.split(r"(?m)^(?=## )", text):
            title = chunk.splitlines()[0][3:].strip() if chunk.startswith("## ") else None
            parts.append((title, chunk))
        return parts

    fresh = {title: chunk.rstrip("\n") + "\n\n" for title, chunk in split(new) if title in titles}
    out = []
    for title, chunk in split(old):
        out.append(fresh.pop(title) if title in fresh else chunk)
    if out and not out[-1].endswith("\n\n"):
        out[-1] = out[-1].rstrip("\n") + "\n\n"
    out += [fresh[title] for title in titles if title in fresh]  # sections the old card lacked
    return "".join(out).rstrip("\n") + "\n"


def _umask() -> int:
    """The process umask (read by setting and restoring it: there is no read-only call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_file(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Write ``path`` through ``write(temporary_path)`` (e.g. ``safetensors.torch.save_file``, which streams to disk
    without a second in-memory copy) so that readers see the old content or the new, never a partial file.

    Raises:
        OSError: the directory is missing or not writable.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{_TMP_INFIX}")
    os.close(fd)
    try:
        # mkstemp creates 0600; the file gets the mode a plain open() would give it (0666 less the umask)
        os.chmod(tmp, 0o666 & ~_umask())
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """``atomic_write_file`` for bytes already in memory.

    Raises:
        OSError: the directory is missing or not writable.
    """
    return atomic_write_file(path, lambda tmp: tmp.write_bytes(data))


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_marker(directory: Path) -> None:
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MARKER]
    files = {str(p.relative_to(directory)): p.stat().st_size for p in paths}
    sha256 = {str(p.relative_to(directory)): _sha256(p) for p in paths}
    with open(directory / MARKER, "w") as f:
        json.dump({"files": files, "sha256": sha256}, f, indent=1)


class DamagedDirectoryError(ValueError):
    """A saved directory that is incomplete or was changed after it was written."""


def verify_directory(directory: str | os.PathLike, what: str = "directory") -> None:
    """Check a directory written by ``atomic_directory`` before trusting it: the completion marker is there, and
    every file it lists but the card (README.md, which people edit) has its recorded size and (for directories
    written since checksums were recorded) its SHA-256. A directory a killed writer moved aside is put back first
    (``remove_stale_temporaries``).

    Raises:
        FileNotFoundError: nothing at ``directory``.
        DamagedDirectoryError: no marker, or a file missing, truncated or changed; the message names the file.
    """
    directory = Path(directory)
    if not directory.exists():
        remove_stale_temporaries(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{what} {directory} does not exist")
    try:
        marker = json.loads((directory / MARKER).read_text())
        sizes = marker["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DamagedDirectoryError(f"{what} {directory} is incomplete: its completion marker {MARKER} is missing "
                                    "or unreadable (a write that did not finish); save it again") from None
    for name, size in sizes.items():
        if name == README_NAME:
            continue  # the card is documentation people edit (as on the Hub); loading never reads it
        path = directory / name
        if not path.is_file():
            raise DamagedDirectoryError(f"{what} {directory}: {name} is missing; save the directory again")
        if path.stat().st_size != size:
            raise DamagedDirectoryError(f"{what} {directory}: {name} has {path.stat().st_size} bytes, {size} were "
                                        "written (truncated or replaced); save the directory again")
    for name, digest in (marker.get("sha256") or {}).items():
        if name != README_NAME and _sha256(directory / name) != digest:
            raise DamagedDirectoryError(f"{what} {directory}: {name} does not have the content that was written "
                                        "(checksum mismatch); save the directory again")


def load_verified_weights(directory: str | os.PathLike, what: str, name: str = WEIGHTS_NAME) -> dict:
    """The tensors of ``directory/name`` after ``verify_directory``, refusing non-finite weights.

    Raises:
        FileNotFoundError, DamagedDirectoryError: see ``verify_directory``.
        DamagedDirectoryError: the file is not a readable safetensors file, or a tensor holds NaN or infinity.
    """
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    verify_directory(directory, what)
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{what} {directory}: no {name}")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a broken header
        raise DamagedDirectoryError(f"{what} {directory}: {name} is not a readable safetensors file ({e}); save "
                                    "the directory again") from None
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DamagedDirectoryError(f"{what} {directory}: tensor {key!r} of {name} holds NaN or infinite "
                                        "values (a diverged training run?); retrain or restore it")
    return tensors


def stored_float_dtype(directory: str | os.PathLike, name: str = WEIGHTS_NAME):
    """The one floating-point dtype ``directory/name`` stores its weights in (``torch.float16`` for a drafter saved
    half-size), or None when they are float32 or mixed: what a rewrite (a new calibration) should store them in again
    so that the file keeps its size and its bits. Reads the header only."""
    import torch
    from safetensors import safe_open

    names = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
    with safe_open(str(Path(directory) / name), framework="pt") as f:
        floats = {f.get_slice(k).get_dtype() for k in f.keys()} & set(names)
    dtype = names[floats.pop()] if len(floats) == 1 else None
    return None if dtype is torch.float32 else dtype


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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where it is unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False  # the kernel or the filesystem cannot exchange: two renames, recovered by readers
    raise OSError(code, os.strerror(code), str(b))


def _move_into_place(tmp: Path, final_path: Path) -> None:
    """Put ``tmp`` at ``final_path``. Replacing an existing directory swaps the two atomically where the system
    can, so the old or the new one is at the path at every instant; elsewhere the old one is moved aside first,
    and a reader that finds nothing puts it back (``remove_stale_temporaries``, called by ``verify_directory``)."""
    exists = final_path.exists() or final_path.is_symlink()
    if exists and final_path.is_dir() and tmp.is_dir() and _exchange(tmp, final_path):
        _fsync_dir(final_path.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous version
        return
    old = None
    if exists:
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
