"""Git environment variables of the caller (a shell, a git hook) never redirect the tool's git."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from toolworld import MAIN, git, run_module, snapshot, tree_snapshot, write


def hostile_env(victim, other_repo, tmp_path) -> dict[str, str]:
    """Every variable that would point git at another work tree, index, repo, config."""
    return {
        **os.environ,
        "GIT_DIR": str(other_repo / ".git"),
        "GIT_WORK_TREE": str(victim),
        "GIT_INDEX_FILE": str(tmp_path / "hook-index"),
        "GIT_OBJECT_DIRECTORY": str(tmp_path / "objects"),
        "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(tmp_path / "alt"),
        "GIT_COMMON_DIR": str(other_repo / ".git"),
        "GIT_NAMESPACE": "evil",
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "core.worktree",
        "GIT_CONFIG_VALUE_0": str(victim),
        "GIT_CONFIG_PARAMETERS": f"'core.hooksPath'='{tmp_path}'",
        "GIT_CEILING_DIRECTORIES": "/",
    }


def test_status_vendor_apply_ignore_redirecting_git_vars(world, project, tmp_path):
    victim = tmp_path / "victim"
    write(victim, "precious.txt", "keep me\n")
    other = world.clone(tmp_path / "other", "core_v0.1.0")
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    before_victim, before_other = tree_snapshot(victim), snapshot(other)
    env = hostile_env(victim, other, tmp_path)

    r = run_module(project, "status", "--json", env=env)
    assert r.rc == 0, r.err
    r = run_module(project, "vendor", env=env)
    assert r.rc == 0, r.err
    r = run_module(project, "apply", co, env=env)
    assert r.rc == 0, r.err
    assert r.out.count(": committed") == 3
    assert git(co, "rev-list", "--count", "core_v0.1.0..HEAD").strip() == "3"

    assert tree_snapshot(victim) == before_victim
    assert snapshot(other) == before_other
    assert not (tmp_path / "hook-index").exists() and not (tmp_path / "objects").exists()


def test_status_from_a_pre_commit_hook_keeps_the_users_commit(world, project, tmp_path):
    """`git commit -a` hands its own index to the hook (GIT_INDEX_FILE): status must not use it."""
    repo = world.clone(tmp_path / "user", "core_v0.1.0")
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text(
        f"#!/bin/sh\ncd {MAIN} && exec {sys.executable} -m mcore_fixes --root {project} "
        "status --json >/dev/null\n"
    )
    hook.chmod(0o755)
    (repo / "README.md").write_text("changed by the user\n")
    git(repo, "commit", "-q", "-a", "-m", "user commit")
    assert git(repo, "show", "HEAD:README.md") == "changed by the user\n"
    assert git(repo, "show", "--stat", "--format=", "HEAD").split()[0] == "README.md"
    assert git(repo, "status", "--porcelain").strip() == ""
    for tree in (project / "build" / "trees").glob("[!.]*"):
        assert git(tree, "status", "--porcelain").strip() == ""


def test_users_apply_config_and_a_cache_that_is_a_file(world, project, tmp_path):
    patch = project / "patches" / "0003-weak-test.patch"
    patch.write_text(patch.read_text().replace("+ANSWER = 42\n", "+ANSWER = 42 \n"))
    cfg = tmp_path / "gitconfig"
    cfg.write_text(
        Path(os.environ["GIT_CONFIG_GLOBAL"]).read_text() + "[apply]\n\twhitespace = error\n"
    )
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    r = run_module(project, "apply", co, env={**os.environ, "GIT_CONFIG_GLOBAL": str(cfg)})
    assert r.rc == 0 and r.out.count(": committed") == 3, r.err

    fresh = world.project(tmp_path / "fresh", prebuilt=False)
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("x")
    r = run_module(fresh, "vendor", env={**os.environ, "MCORE_FIXES_CACHE": str(not_a_dir)})
    assert r.rc == 2 and "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert f"the download cache {not_a_dir} is not a usable directory" in r.err
    assert not_a_dir.read_text() == "x"
