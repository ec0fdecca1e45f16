"""Fixtures for the mcore_fixes tool tests (the synthetic world lives in toolworld.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from toolworld import Result, World, build_world, cli

from mcore_fixes.maint import forkserver


@pytest.fixture(scope="session", autouse=True)
def _hermetic_env(tmp_path_factory):
    """Own git config, own cache, no package index: nothing leaves this machine."""
    base = tmp_path_factory.mktemp("env")
    gitconfig = base / "gitconfig"
    gitconfig.write_text(
        "[user]\n\tname = Test Runner\n\temail = runner@example.com\n"
        "[init]\n\tdefaultBranch = main\n[advice]\n\tdetachedHead = false\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
        mp.setenv("GIT_CONFIG_NOSYSTEM", "1")
        mp.setenv("MCORE_FIXES_CACHE", str(base / "cache"))
        mp.delenv("MCORE_REPO", raising=False)
        for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
            mp.delenv(var, raising=False)
        mp.setenv("PIP_NO_INDEX", "1")
        mp.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        mp.setenv("PIP_CONFIG_FILE", os.devnull)
        mp.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        mp.setenv("PIP_NO_CACHE_DIR", "1")
        mp.delenv("PIP_FIND_LINKS", raising=False)
        mp.setenv("PYTHONDONTWRITEBYTECODE", "1")
        # `prove` runs pytest in subprocesses: keep them lean (no third-party plugins).
        mp.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        yield


@pytest.fixture(autouse=True)
def _lean_fork_server(monkeypatch):
    """`prove`'s fork server preloads only pytest: the toy megatron imports no torch."""
    monkeypatch.setattr(forkserver, "PRELOAD", ("pytest",))


@pytest.fixture(scope="session")
def world(tmp_path_factory, _hermetic_env) -> World:
    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture
def project(world, tmp_path) -> Path:
    """A private copy of the toy project root (patches/ + pre-built pristine trees)."""
    return world.project(tmp_path / "proj")


@pytest.fixture
def tool(capsys):
    """Run `mcore_fixes.cli.main(["--root", root, *args])` in process; returns a Result."""

    def run(root: Path, *args: str) -> Result:
        capsys.readouterr()
        rc = cli.main(["--root", str(root), *map(str, args)])
        out, err = capsys.readouterr()
        return Result(rc, out, err)

    return run
