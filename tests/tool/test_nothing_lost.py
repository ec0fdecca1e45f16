"""Nothing of the user's is overwritten or written through, and no unverified code is shipped.

`apply` never overwrites an ignored or untracked file the series would create and puts the
checkout back exactly when git fails partway; `vendor` never writes through a symlink out of
the project; the download cache is verified by the bytes extracted, not by a path reopened;
a pristine tree is reused only while it is the one built from the pin; `pip wheel .` labels
edits of the vendored tree even without build/.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from test_bad_input import needs_pip, one_line
from toolworld import MAIN, TEST_FILES, git, run_module, snapshot, tree_snapshot, write

SDIST = "megatron_core-0.1.0.tar.gz"


# --- apply --------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["ignored", "untracked"])
def test_apply_never_overwrites_a_file_the_series_would_create(world, project, tool, tmp_path, how):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    rel = TEST_FILES["fix-mean"]
    if how == "ignored":
        with (co / ".git/info/exclude").open("a") as f:
            f.write(f"/{rel}\n")
    write(co, rel, "# my own test, not committed\n")
    before = snapshot(co)
    for extra in ([], ["--no-commit"]):
        r = tool(project, "apply", co, *extra)
        assert r.rc == 1, r.text
        assert rel in one_line(r.err) and "exists" in r.err
        assert snapshot(co) == before
    (co / rel).unlink()  # moved away: the series applies
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err


SMUDGE_FAILS = {
    "filter.boom.smudge": "false",
    "filter.boom.clean": "cat",
    "filter.boom.required": "true",
}


def test_apply_whose_checkout_fails_partway_puts_everything_back(world, project, tool, tmp_path):
    """git writes some files, then a required smudge filter fails: every file is put back, the
    run says so truthfully, and the next run (filter fixed) applies without blaming the user."""
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    (co / ".git/info/attributes").write_text("megatron/core/util.py filter=boom\n")
    for key, value in SMUDGE_FAILS.items():
        git(co, "config", key, value)
    before = snapshot(co)
    for extra in ([], ["--no-commit"]):
        r = tool(project, "apply", co, *extra)
        assert r.rc == 1, r.text
        assert "left unchanged" in one_line(r.err) and "smudge filter boom failed" in r.err
        assert snapshot(co) == before
        assert not (
            Path(git(co, "rev-parse", "--absolute-git-dir").strip()) / "mcore-fixes"
        ).exists()
    git(co, "config", "filter.boom.smudge", "cat")
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert git(co, "rev-list", "--count", "core_v0.1.0..HEAD").strip() == "3"
    assert git(co, "status", "--porcelain").strip() == ""


def test_apply_on_an_unborn_head_is_one_line(world, project, tool, tmp_path):
    co = tmp_path / "co"
    git(world.base, "init", "-q", str(co))
    write(co, "megatron/core/package_info.py", "MAJOR = 0\nMINOR = 1\nPATCH = 0\n")
    for extra in ([], ["--baseline", "0.1.0"]):
        r = tool(project, "apply", co, *extra)
        assert r.rc == 2
        assert "has no commit yet" in one_line(r.err)


# --- vendor -------------------------------------------------------------------------------------


def test_vendor_never_writes_through_a_symlink_out_of_the_project(world, project, tool, tmp_path):
    """tests/unit_tests -> the user's Megatron-LM checkout: refused, their files untouched."""
    co = world.clone(tmp_path / "Megatron-LM", "core_v0.1.0")
    write(co, "tests/unit_tests/test_basic.py", "def test_basic():\n    pass  # my edit\n")
    write(co, TEST_FILES["fix-mean"], "# my own, untracked\n")
    (project / "tests").mkdir(exist_ok=True)
    (project / "tests/unit_tests").symlink_to(co / "tests/unit_tests")
    before = snapshot(co)
    for extra in ([], ["--force"]):
        r = tool(project, "vendor", *extra)
        assert r.rc == 2, r.text
        assert "tests/unit_tests is a symlink" in one_line(r.err)
        assert snapshot(co) == before
        assert not (project / "megatron").exists()


def test_vendor_never_deletes_through_a_symlink_out_of_the_project(world, project, tool, tmp_path):
    """A test file vendor wrote before, now reached through a symlink: not deleted there."""
    assert tool(project, "vendor").rc == 0
    co = world.clone(tmp_path / "Megatron-LM", "core_v0.1.0")
    write(co, TEST_FILES["weak-test"], "# my own, untracked\n")
    shutil.rmtree(project / "tests/unit_tests")
    (project / "tests/unit_tests").symlink_to(co / "tests/unit_tests")
    before = snapshot(co)
    r = tool(project, "vendor", "--baseline", "core_v0.1.1", "--force")  # no weak-test there
    assert r.rc == 2 and "tests/unit_tests is a symlink" in one_line(r.err)
    assert snapshot(co) == before


def test_vendor_never_overwrites_a_test_file_it_did_not_write(project, tool):
    write(project, TEST_FILES["fix-mean"], "# my own test\n")
    r = tool(project, "vendor")
    assert r.rc == 1 and TEST_FILES["fix-mean"] in one_line(r.err)
    assert (project / TEST_FILES["fix-mean"]).read_text() == "# my own test\n"
    assert not (project / "megatron").exists()
    assert tool(project, "vendor", "--force").rc == 0  # --force: discard it


# --- the download cache and the tool's trees ----------------------------------------------------


def _evil_sdist(genuine: Path, dest: Path) -> None:
    """The genuine sdist plus megatron/core/PWNED.py."""
    with tarfile.open(genuine) as old, tarfile.open(dest, "w:gz") as new:
        for m in old.getmembers():
            new.addfile(m, old.extractfile(m) if m.isfile() else None)
        info = tarfile.TarInfo("megatron_core-0.1.0/megatron/core/PWNED.py")
        payload = b"raise SystemExit('pwned')\n"
        info.size = len(payload)
        import io

        new.addfile(info, io.BytesIO(payload))


_SWAP: dict[str, object] = {}


def _audit(event: str, args: tuple) -> None:
    """Replace the cached sdist with the attacker's right before its second opening."""
    if event != "open" or not _SWAP or isinstance(args[0], int) or args[0] is None:
        return
    if os.fsdecode(args[0]) == _SWAP["path"]:
        _SWAP["opens"] = int(_SWAP["opens"]) + 1  # type: ignore[call-overload]
        if _SWAP["opens"] == 2:
            os.replace(str(_SWAP["evil"]), str(_SWAP["path"]))


sys.addaudithook(_audit)  # inert while _SWAP is empty


def test_a_cache_swapped_after_the_hash_check_is_never_extracted(
    world, tool, tmp_path, monkeypatch
):
    """A world-writable cache: the file is replaced between the hash check and the extraction
    (deterministically, right before it is opened a second time). Only verified bytes land."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(world.cache / SDIST, cache / SDIST)
    _evil_sdist(world.cache / SDIST, tmp_path / "evil.tar.gz")
    monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
    project = world.project(tmp_path / "proj", prebuilt=False)
    _SWAP.update(path=str(cache / SDIST), evil=str(tmp_path / "evil.tar.gz"), opens=0)
    try:
        r = tool(project, "vendor")
    finally:
        _SWAP.clear()
    assert r.rc == 0, r.err
    assert not (project / "megatron/core/PWNED.py").exists()
    assert not list((project / "build/trees").rglob("PWNED.py"))


def test_a_tampered_pristine_tree_is_rebuilt_not_shipped(world, project, tool):
    """build/trees/<baseline> changed after it was built (its pin file kept): rebuilt from
    the verified source before anything is vendored from it."""
    tree = project / "build/trees/0.1.0"
    write(tree, "megatron/core/PWNED.py", "raise SystemExit('pwned')\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--amend", "--no-edit")
    git(tree, "tag", "-f", "pristine")
    r = tool(project, "vendor")
    assert r.rc == 0, r.err
    assert not (project / "megatron/core/PWNED.py").exists()
    assert not (tree / "megatron/core/PWNED.py").exists()


# --- setup.py -----------------------------------------------------------------------------------


@pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("setuptools", "pybind11")),
    reason="setup.py needs setuptools and pybind11 (the build requirements)",
)
def test_an_edit_is_labelled_even_after_rm_rf_build(world, tmp_path):
    root = world.project(tmp_path / "clone")
    for name in ("setup.py", "README.md"):
        shutil.copy(MAIN / name, root / name)
    shutil.copytree(
        MAIN / "mcore_fixes", root / "mcore_fixes", ignore=shutil.ignore_patterns("__pycache__")
    )

    def version() -> str:
        proc = subprocess.run(
            [sys.executable, "setup.py", "-q", "--version"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert version() == "0.1.0+fixes.3\n"
    shutil.rmtree(root / "build")
    assert version() == "0.1.0+fixes.3\n"  # untouched: no label
    calc = root / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# not exported\n")
    assert version() == "0.1.0+fixes.3.edited\n"
    (root / "megatron/core/util.py").unlink()
    calc.write_text(calc.read_text().replace("# not exported\n", ""))
    assert version() == "0.1.0+fixes.3.edited\n"
    assert run_module(root, "vendor", "--force").rc == 0
    calc.write_text(calc.read_text() + "# exported\n")
    assert run_module(root, "export").rc == 0  # the edit is now the series'
    shutil.rmtree(root / "build")
    assert version() == "0.1.0+fixes.3\n"


# --- export -------------------------------------------------------------------------------------


def test_export_of_a_file_that_is_not_utf8_is_one_line(project, tool):
    assert tool(project, "vendor").rc == 0
    calc = project / "megatron/core/calc.py"
    calc.write_bytes(calc.read_bytes() + b"# caf\xe9\n")
    before = tree_snapshot(project / "patches")
    r = run_module(project, "export")
    assert r.rc == 2
    assert "megatron/core/calc.py" in one_line(r.err) and "UTF-8" in r.err
    assert tree_snapshot(project / "patches") == before


def test_apply_killed_while_git_writes_the_files_is_undone_by_the_next_run(
    world, project, tmp_path
):
    """Killed while git writes the files (some written, some not): the next run puts them
    back, says so, and applies; it does not take the tool's own leftovers for the user's."""
    from test_interrupts import start

    co = world.clone(tmp_path / "co", "core_v0.1.0")
    reached = tmp_path / "reached"
    slow = tmp_path / "slow-smudge"
    slow.write_text(f"#!/bin/sh\ntouch '{reached}'\nsleep 60\ncat\n")
    slow.chmod(0o755)
    (co / ".git/info/attributes").write_text("megatron/core/util.py filter=slow\n")
    git(co, "config", "filter.slow.smudge", str(slow))
    git(co, "config", "filter.slow.clean", "cat")
    before = snapshot(co)
    proc = start(project, "apply", co, env=dict(os.environ))
    deadline = time.monotonic() + 60
    while not reached.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (co / "megatron/core/constants.py").exists()  # git had written some files
    git(co, "config", "--unset", "filter.slow.smudge")
    killed = snapshot(co)
    r = run_module(project, "apply", co)  # git's index.lock of the killed git stays: refused
    assert r.rc == 1 and "a git process" in one_line(r.err) and "index.lock" in r.err
    assert snapshot(co) == killed  # nothing undone under a lock a running git may hold
    (co / ".git/index.lock").unlink()  # as it says: remove it if no git runs there
    r = run_module(project, "unapply", co)  # undone first, then nothing to unapply
    assert r.rc == 1 and "nothing to undo" in r.err
    assert snapshot(co)["files"] == before["files"]
    r = run_module(project, "apply", co, "--no-commit")
    assert r.rc == 0, r.err
    r = run_module(project, "apply", co)
    assert r.rc == 1 and "applied but not committed" in r.err
    git(co, "reset", "-q", "--hard")
    assert snapshot(co) == before


@needs_pip
def test_a_link_or_fifo_planted_in_the_cache_is_left_alone(world, tool, tmp_path, monkeypatch):
    """Others may write the cache: a `.download-*` symlink to a folder of the user is not
    cleaned up through, and a FIFO there does not hang the download."""
    cache, mine, links = tmp_path / "cache", tmp_path / "mine", tmp_path / "links"
    cache.mkdir()
    links.mkdir()
    write(mine, "precious.txt", "keep me\n")
    (cache / ".download-evil").symlink_to(mine)
    os.mkfifo(cache / ".download-fifo")
    shutil.copy(world.cache / SDIST, links / SDIST)
    monkeypatch.setenv("MCORE_FIXES_CACHE", str(cache))
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    project = world.project(tmp_path / "proj", prebuilt=False)
    r = tool(project, "vendor")
    assert r.rc == 0, r.err
    assert (mine / "precious.txt").read_text() == "keep me\n"
    assert (cache / "sha256" / world.sdist_sha / SDIST).read_bytes() == (links / SDIST).read_bytes()
