"""PyPI sdists: nothing unverified runs, the cache is keyed by hash, broken archives are refused."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from test_bad_input import needs_pip, one_line
from toolworld import MAIN, sha256, tree_snapshot

from mcore_fixes import sources
from mcore_fixes.manifest import Baseline
from mcore_fixes.progress import Progress

SDIST = "megatron_core-0.1.0.tar.gz"


def rewrite_sdist(src: Path, dest: Path, replace: dict[str, bytes], top: str = "") -> None:
    """Copy an sdist, replacing (or adding) members by their path below the top folder."""
    with tarfile.open(src) as old, tarfile.open(dest, "w:gz") as new:
        prefix = old.getmembers()[0].name.split("/")[0]
        todo = dict(replace)
        for m in old.getmembers():
            rel = m.name.partition("/")[2]
            data = old.extractfile(m) if m.isfile() else None
            if rel in todo:
                payload = todo.pop(rel)
                m.size, data = len(payload), io.BytesIO(payload)
            if top:
                m.name = m.name.replace(prefix, top, 1)
            new.addfile(m, data)
        for rel, payload in todo.items():
            info = tarfile.TarInfo(f"{top or prefix}/{rel}")
            info.size = len(payload)
            new.addfile(info, io.BytesIO(payload))


def pin(project: Path, old: str, new: str) -> None:
    manifest = project / "patches" / "manifest.toml"
    manifest.write_text(manifest.read_text().replace(old, new))


@needs_pip
def test_planted_build_backend_never_runs(world, tool, tmp_path, monkeypatch):
    """The index serves other bytes with a build backend: pip refuses them before preparing."""
    links, cache, marker = tmp_path / "links", tmp_path / "cache", tmp_path / "PWNED"
    links.mkdir()
    with tarfile.open(world.cache / SDIST) as tar:
        original = tar.extractfile("megatron_core-0.1.0/fake_backend.py").read()
    planted = f"open({str(marker)!r}, 'w').write('ran')\n".encode() + original
    rewrite_sdist(world.cache / SDIST, links / SDIST, {"fake_backend.py": planted})
    monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    project = world.project(tmp_path / "proj", prebuilt=False)
    r = tool(project, "vendor")
    assert r.rc == 2
    msg = one_line(r.err)
    assert f"the package index serves {sha256(links / SDIST)}" in msg, msg
    assert "before anything in it ran" in msg
    assert not marker.exists()
    assert tree_snapshot(cache) == {}
    assert not (project / "megatron").exists()
    assert [p.name for p in (project / "build" / "trees").iterdir()] == []


@needs_pip
def test_wrong_pin_never_deletes_a_good_cached_file(world, tool, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / SDIST).write_bytes((world.cache / SDIST).read_bytes())
    keyed = cache / "sha256" / world.sdist_sha
    keyed.mkdir(parents=True)
    (keyed / SDIST).write_bytes((world.cache / SDIST).read_bytes())
    before = tree_snapshot(cache)
    monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
    project = world.project(tmp_path / "proj", prebuilt=False)
    pin(project, world.sdist_sha, "0" * 64)
    r = tool(project, "vendor")
    assert r.rc == 2
    assert "left alone" in one_line(r.err)
    assert tree_snapshot(cache) == before
    assert sorted(p.name for p in (cache / "sha256").iterdir()) == [world.sdist_sha]

    pin(project, "0" * 64, world.sdist_sha)  # the right pin finds the file again
    r = tool(project, "vendor")
    assert r.rc == 0, r.err


def broken_archives(good: Path) -> dict[str, bytes]:
    data = good.read_bytes()
    plain = gzip.decompress(data)
    return {
        "truncated gzip": data[: len(data) // 2],
        "not gzip (a plain tar)": plain,
        "empty": b"",
        "gzip of garbage": gzip.compress(b"x" * 1000),
    }


def test_broken_archive_with_matching_pin_is_one_line(world, tool, tmp_path, monkeypatch):
    for i, (what, payload) in enumerate(broken_archives(world.cache / SDIST).items()):
        cache = tmp_path / f"cache{i}"
        cache.mkdir()
        (cache / SDIST).write_bytes(payload)
        monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
        project = world.project(tmp_path / f"proj{i}", prebuilt=False)
        pin(project, world.sdist_sha, sha256(cache / SDIST))
        r = tool(project, "vendor")
        assert r.rc == 2, what
        assert "is not a readable .tar.gz archive" in one_line(r.err), what
        assert (cache / SDIST).read_bytes() == payload
        assert not (project / "megatron").exists()
        assert [p.name for p in (project / "build" / "trees").iterdir()] == [], what


@needs_pip
def test_download_of_an_sdist_requiring_python_3_12(world, tmp_path, monkeypatch):
    """0.17+ sdists declare Requires-Python >=3.12; the tool (maybe on 3.11) only reads them."""
    links, cache = tmp_path / "links", tmp_path / "cache"
    links.mkdir()
    with tarfile.open(world.cache / SDIST) as tar:
        pyproject = tar.extractfile("megatron_core-0.1.0/pyproject.toml").read().decode()
        info = tar.extractfile("megatron_core-0.1.0/megatron/core/package_info.py").read()
    pyproject = pyproject.replace(
        'name = "megatron-core"', 'name = "megatron-core"\nrequires-python = ">=3.12"'
    )
    replace = {
        "pyproject.toml": pyproject.encode(),
        "megatron/core/package_info.py": info.replace(b"MINOR = 1", b"MINOR = 9"),
        "PKG-INFO": b"Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.9.0\n"
        b"Requires-Python: >=3.12\n",
    }
    sdist = links / "megatron_core-0.9.0.tar.gz"
    rewrite_sdist(world.cache / SDIST, sdist, replace, top="megatron_core-0.9.0")
    monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    b = Baseline(name="0.9.0", source="pypi", version="0.9.0", sha256=sha256(sdist))
    got, data = sources.fetch_sdist(b, Progress(False))
    assert got == cache / "sha256" / b.sha256 / sdist.name
    assert got.read_bytes() == data == sdist.read_bytes()


BACKEND = """import os, subprocess, sys


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    # What setup.py does when megatron/ is absent, inside pip's isolated build environment.
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_fixes", "--root", os.environ["PROJECT"], "vendor"],
        cwd=os.environ["MAIN"], capture_output=True, text=True,
    )
    with open(os.environ["RESULT"], "w") as f:
        f.write(f"{proc.returncode}\\n{proc.stderr}")
    raise RuntimeError("done")
"""


@needs_pip
def test_download_from_inside_pips_isolated_build_env(world, tmp_path):
    """`pip install .` of a fresh clone: setup.py vendors inside pip's build isolation."""
    links, cache, pkg = tmp_path / "links", tmp_path / "cache", tmp_path / "pkg"
    links.mkdir()
    pkg.mkdir()
    shutil.copy(world.cache / SDIST, links / SDIST)
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "probe"\nbackend-path = ["."]\n'
    )
    (pkg / "probe.py").write_text(BACKEND)
    project = world.project(tmp_path / "proj", prebuilt=False)
    env = {
        **os.environ,
        "MCORE_FIXES_CACHE": str(cache),
        "PIP_FIND_LINKS": str(links),
        "PROJECT": str(project),
        "MAIN": str(MAIN),
        "RESULT": str(tmp_path / "result"),
    }
    pip = shutil.which("pip") or shutil.which("pip3")
    subprocess.run(
        [pip, "wheel", "--no-deps", "-q", "-w", str(tmp_path / "out"), str(pkg)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    rc, _, err = (tmp_path / "result").read_text().partition("\n")
    assert rc == "0", err
    assert (project / "megatron/core/calc.py").exists()
    assert (cache / "sha256" / world.sdist_sha / SDIST).exists()


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = ""):
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, len(data), link
    return info, (io.BytesIO(data) if data else None)


def planted_archives(good: Path) -> dict[str, tuple[list, str]]:
    """Archives whose hash the manifest pins (so they get past the pin check), each crafted to
    break extraction one way; with the words its one error line must contain."""
    top = "megatron_core-0.1.0"
    info = f"{top}/megatron/core/package_info.py"
    return {
        "hardlink to a missing member": (
            [_member(f"{top}/megatron/core/x.py", tarfile.LNKTYPE, link=f"{top}/nope.py")],
            "hardlink to",
        ),
        "symlink": (
            [_member(f"{top}/megatron/core/x.py", tarfile.SYMTYPE, link="calc.py")],
            "a symlink",
        ),
        "absolute path": ([_member("/etc/megatron.py", data=b"x")], "escapes the target"),
        "dot-dot": ([_member(f"{top}/../../evil.py", data=b"x")], "escapes the target"),
        "device file": ([_member(f"{top}/megatron/core/dev", tarfile.CHRTYPE)], "not a file"),
        "fifo": ([_member(f"{top}/megatron/core/fifo", tarfile.FIFOTYPE)], "not a file"),
        "duplicate member": ([_member(info, data=b"MAJOR = 9\n")], "occurs twice"),
    }


def test_planted_archive_with_matching_pin_is_one_line(world, tool, tmp_path, monkeypatch):
    """Every malformed member: one error line naming the archive, exit 2, nothing extracted."""
    for i, (what, (extra, words)) in enumerate(planted_archives(world.cache / SDIST).items()):
        cache = tmp_path / f"cache{i}"
        cache.mkdir()
        sdist = cache / SDIST
        with tarfile.open(world.cache / SDIST) as old, tarfile.open(sdist, "w:gz") as new:
            for m in old.getmembers():
                new.addfile(m, old.extractfile(m) if m.isfile() else None)
            for m, data in extra:
                new.addfile(m, data)
        monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
        project = world.project(tmp_path / f"proj{i}", prebuilt=False)
        pin(project, world.sdist_sha, sha256(sdist))
        r = tool(project, "vendor")
        assert r.rc == 2, (what, r.err)
        msg = one_line(r.err)
        assert str(sdist) in msg and words in msg, (what, msg)
        assert "Traceback" not in r.err
        assert not (project / "megatron").exists(), what
        assert [p.name for p in (project / "build" / "trees").iterdir()] == [], what


def test_huge_member_count_is_refused_before_extracting(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_MEMBERS", 5)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for n in range(10):
            m, data = _member(f"top/megatron/core/f{n}.py", data=b"x")
            tar.addfile(m, data)
    buf.seek(0)
    dest = tmp_path / "dest"
    dest.mkdir()
    with tarfile.open(fileobj=buf) as tar:
        try:
            sources.safe_extract(tar, dest, strip=1, keep=("megatron/core",))
        except sources.UserError as exc:
            assert "more than 5 members" in str(exc)
        else:
            raise AssertionError("a huge archive was extracted")
    assert list(dest.iterdir()) == []
