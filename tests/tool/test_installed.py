"""`info` names the megatron-core Python imports: the installed distribution providing it, or
the source tree that shadows it; never a clone's stale build metadata."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toolworld import MAIN, Result, run_module, write


def install_fake(site: Path, version: str, record: dict | None = None) -> None:
    """A megatron-core installed by pip into `site`: its files and a dist-info with RECORD."""
    files = {"megatron/core/__init__.py": '"""Installed Megatron-Core."""\n'}
    if record is not None:
        files["megatron/core/_mcore_fixes.json"] = json.dumps(record)
    info = f"megatron_core-{version}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n"
    files[f"{info}/INSTALLER"] = "pip\n"
    for rel, text in files.items():
        write(site, rel, text)
    write(site, f"{info}/RECORD", "".join(f"{rel},,\n" for rel in [*files, f"{info}/RECORD"]))


@pytest.fixture
def tool_only(tmp_path) -> Path:
    """The tool alone on a folder (no clone, no vendored ./megatron next to it)."""
    shutil.copytree(
        MAIN / "mcore_fixes", tmp_path / "tool" / "mcore_fixes",
        ignore=shutil.ignore_patterns("__pycache__"),
    )  # fmt: skip
    return tmp_path / "tool"


def info(cwd: Path, *path: Path) -> Result:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    return run_module(cwd, "info", cwd=cwd, env=env)


def test_info_names_the_installed_pristine_distribution(tool_only, tmp_path):
    install_fake(tmp_path / "site", "0.1.0")
    r = info(tmp_path, tool_only, tmp_path / "site")
    assert r.rc == 1, r.err
    assert f"megatron.core at {tmp_path / 'site/megatron/core'}\n" in r.out
    assert (
        "distribution megatron-core 0.1.0, pristine: no mcore-fixes patch "
        f"(installed in {tmp_path / 'site'})"
    ) in r.out
    assert "not an mcore-fixes build: no _mcore_fixes.json in" in r.out


def runtime(site: Path, torch: str | None = "2.6.0", psutil: bool = True) -> None:
    """Shims of what the installed fork imports at run time: torch at a version, psutil."""
    if torch is not None:
        write(site, "torch/__init__.py", f"__version__ = {torch!r}\n")
    if psutil:
        write(site, "psutil/__init__.py", "")


def test_info_of_an_installed_fork(project, tool, tool_only, tmp_path):
    assert tool(project, "vendor").rc == 0
    record = json.loads((project / "megatron/core/_mcore_fixes.json").read_text())
    install_fake(tmp_path / "site", "0.1.0+fixes.3", record)
    runtime(tmp_path / "site")
    r = info(tmp_path, tool_only, tmp_path / "site")
    assert r.rc == 0, r.err
    assert (
        "distribution megatron-core 0.1.0+fixes.3, the mcore-fixes fork "
        f"(installed in {tmp_path / 'site'})"
    ) in r.out
    assert "base: 0.1.0 (pypi, pin " in r.out
    assert "applied   fix-mean (fix 1; 0001-fix-mean.patch)" in r.out
    env = {**os.environ, "PYTHONPATH": f"{tool_only}{os.pathsep}{tmp_path / 'site'}"}
    data = json.loads(run_module(tmp_path, "info", "--json", cwd=tmp_path, env=env).out)
    assert data["distribution"] == "0.1.0+fixes.3" and data["baseline"] == "0.1.0" and data["fork"]
    assert data["missing"] is None


def installed_fork(project, tool, site: Path, torch_requirement: str) -> None:
    assert tool(project, "vendor").rc == 0
    record = json.loads((project / "megatron/core/_mcore_fixes.json").read_text())
    record["base_metadata"]["dependencies"] = [torch_requirement, "numpy"]
    install_fake(site, "0.1.0+fixes.3", record)


@pytest.mark.parametrize(
    ("torch", "psutil", "said"),
    [
        (None, True, "torch does not import (ModuleNotFoundError: No module named 'torch'): "
         "install torch>=2.6.0 with the command pytorch.org gives for your machine (a bare "
         "`pip install torch` may replace a CUDA build by another)"),
        ("2.1.0", True, "torch 2.1.0 is older than 2.6.0, what base 0.1.0 requires: upgrade to "
         "torch>=2.6.0 with the command pytorch.org gives"),
        ("2.6.0", False, "psutil does not import (saving a torch_dist checkpoint needs it): "
         "`pip install psutil`"),
        (None, False, "; psutil does not import"),
    ],
)  # fmt: skip
def test_info_refuses_an_installed_fork_that_cannot_run(
    project, tool, tool_only, tmp_path, torch, psutil, said
):
    # pip installs the fork without torch, and with --no-deps without psutil: pip check is
    # clean, then `import megatron.core.optimizer` fails, or a torch_dist save hangs.
    installed_fork(project, tool, tmp_path / "site", "torch>=2.6.0")
    runtime(tmp_path / "site", torch, psutil)
    r = info(tmp_path, tool_only, tmp_path / "site")
    assert r.rc == 1 and "Traceback" not in r.err
    assert r.err.count("\n") == 1 and "the fork is installed but cannot run here: " in r.err
    assert said in r.err
    assert "base: 0.1.0 (pypi" in r.out  # what is installed is still said


def test_info_takes_a_cuda_or_ngc_torch_as_its_release(project, tool, tool_only, tmp_path):
    installed_fork(project, tool, tmp_path / "site", "torch>=2.6.0,<3")
    runtime(tmp_path / "site", "2.6.0a0+ecf3bae40a.nv25.01")
    assert info(tmp_path, tool_only, tmp_path / "site").rc == 0


def test_info_without_a_torch_minimum_asks_for_any_torch(project, tool, tool_only, tmp_path):
    installed_fork(project, tool, tmp_path / "site", "torch")
    runtime(tmp_path / "site", "1.0", psutil=True)
    assert info(tmp_path, tool_only, tmp_path / "site").rc == 0
    (tmp_path / "site/torch/__init__.py").write_text(
        "raise OSError('libcudart.so.12: cannot open')\n"
    )
    r = info(tmp_path, tool_only, tmp_path / "site")
    assert r.rc == 1 and "torch does not import (OSError: libcudart.so.12: cannot open): " in r.err
    assert "install torch with the command pytorch.org gives" in r.err


def test_info_in_a_clone_names_the_tree_that_shadows_the_installed_one(
    project, tool, tool_only, tmp_path
):
    # Run from the project root: ./megatron (vendored) is imported, not the installed
    # pristine package; the clone's stale build metadata (egg-info) is no installation.
    assert tool(project, "vendor").rc == 0
    write(project, "setup.py", "")
    write(project, "megatron_core.egg-info/PKG-INFO", "Name: megatron-core\nVersion: 9.9+fixes.7\n")
    write(project, "megatron_core.egg-info/SOURCES.txt", "megatron/core/__init__.py\n")
    install_fake(tmp_path / "site", "0.1.0")
    r = info(project, tool_only, tmp_path / "site")
    assert r.rc == 0, r.err
    assert (
        "installed: megatron-core 0.1.0, pristine: no mcore-fixes patch "
        f"(installed in {tmp_path / 'site'})\n"
        f"here: megatron.core at {project / 'megatron/core'}, a tree vendored by "
        "`python -m mcore_fixes vendor`, not installed: first on sys.path"
    ) in r.out
    assert "9.9" not in r.out
    assert "base: 0.1.0 (pypi" in r.out


def test_info_without_any_megatron_core_is_one_line(tool_only, tmp_path):
    r = info(tmp_path, tool_only)
    assert r.rc == 2 and "Traceback" not in r.err
    assert r.err.startswith("mcore_fixes: error: megatron.core is not importable here")


def installed(project: Path, lib: Path) -> Path:
    """The tool as `pip install <clone>` lays it out in `lib`: mcore_fixes/ with patches/
    inside, no clone around."""
    shutil.copytree(
        MAIN / "mcore_fixes", lib / "mcore_fixes", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(project / "patches", lib / "mcore_fixes" / "patches")
    return lib


def test_the_installed_tool_runs_from_anywhere_with_the_series_it_carries(world, project, tmp_path):
    lib = installed(project, tmp_path / "lib")
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(lib)}

    def run(*args: str) -> Result:
        return run_module_plain(elsewhere, env, *args)

    r = run("apply", "--dry-run", str(co))
    assert r.rc == 0, r.err
    assert "fix-mean: would be committed (patches/0001-fix-mean.patch)" in r.out
    r = run("apply", str(co))
    assert r.rc == 0 and "fix-mean: committed" in r.out, r.err
    r = run("status", "--baseline", "0.1.0")
    assert r.rc == 0, r.err
    assert "applies" in r.out
    r = run("unapply", str(co))
    assert r.rc == 0, r.err
    r = run("vendor")
    assert r.rc == 2 and r.err.strip().count("\n") == 0
    assert "`vendor` works on a clone of mcore-fixes" in r.err
    assert list(elsewhere.iterdir()) == []  # its work folder is in the cache, not here


def run_module_plain(cwd: Path, env: dict[str, str], *args: str) -> Result:
    """`python -m mcore_fixes ARGS` without --root: the tool finds its own series."""
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_fixes", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return Result(proc.returncode, proc.stdout, proc.stderr)


def test_the_installed_tools_apply_and_unapply_make_no_cache_folder(world, project, tmp_path):
    """A dry run writes nothing anywhere; apply and unapply work in the checkout alone."""
    lib = installed(project, tmp_path / "lib")
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(lib), "MCORE_FIXES_CACHE": str(cache)}
    for args in (("apply", "--dry-run"), ("apply",), ("unapply",)):
        r = run_module_plain(tmp_path, env, *args, str(co))
        assert r.rc == 0, r.err
        assert not cache.exists(), args
