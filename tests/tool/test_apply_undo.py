"""`apply --dry-run` (nothing written), `unapply` (the way back), and a detached HEAD."""

from __future__ import annotations

import pytest
from toolworld import CALC_BUGGY, TEST_FILES, git, snapshot, tree_snapshot, write


def test_dry_run_says_what_would_change_and_writes_nothing(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    write(co, "README.md", "unrelated work in progress\n")
    before = snapshot(co)  # (git status may refresh the index: before the .git snapshot)
    gitdir = tree_snapshot(co / ".git")
    r = tool(project, "apply", "--dry-run", co)
    assert r.rc == 0, r.err
    assert "baseline 0.1.0 (megatron/core/package_info.py says 0.1.0" in r.out
    assert "  fix-mean: would be committed (patches/0001-fix-mean.patch)" in r.out
    assert "\n  fix 1:\n    fix-mean: would be committed" in r.out  # under its fix's name
    assert "  weak-test: would be committed (patches/0003-weak-test.patch)" in r.out
    assert "dry run, nothing written: the series would change 6 file(s):" in r.out
    assert "  megatron/core/calc.py\n" in r.out and f"  {TEST_FILES['join-sep']}\n" in r.out
    assert tree_snapshot(co / ".git") == gitdir  # no object, no index, no ref, no lock
    assert snapshot(co) == before

    r = tool(project, "apply", "--dry-run", "--no-commit", co)
    assert r.rc == 0 and r.out.count("would be staged (not committed)") == 3
    assert snapshot(co) == before

    # What a real apply would refuse, a dry run refuses the same way.
    write(co, "megatron/core/calc.py", CALC_BUGGY + "# work in progress\n")
    r = tool(project, "apply", "--dry-run", co)
    assert r.rc == 1 and "uncommitted changes in files the series touches" in r.err


def test_dry_run_of_an_applied_series_is_a_noop(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    assert tool(project, "apply", co).rc == 0
    r = tool(project, "apply", "--dry-run", co)
    assert r.rc == 0 and "nothing to do" in r.out and "dry run" not in r.out


def test_unapply_goes_back_and_keeps_uncommitted_work(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    base = git(co, "rev-parse", "HEAD").strip()
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert f"undo: python -m mcore_fixes unapply {co}   (HEAD was {base[:12]})" in r.out
    # Work after the apply: staged and further edited, unstaged, untracked.
    write(co, "README.md", "staged\n")
    git(co, "add", "README.md")
    write(co, "README.md", "staged, then edited\n")
    write(co, "megatron/core/__init__.py", '"""Edited, not staged."""\n')
    write(co, "notes.txt", "untracked\n")
    index = git(co, "ls-files", "-s", "README.md")

    r = tool(project, "unapply", co)
    assert r.rc == 0, r.err
    assert f"HEAD back at {base[:12]}, where `apply` found it" in r.out
    assert git(co, "rev-parse", "HEAD").strip() == base
    assert git(co, "symbolic-ref", "HEAD").strip() == "refs/heads/work"  # the branch moved back
    assert (co / "megatron/core/calc.py").read_text() == CALC_BUGGY
    assert not (co / TEST_FILES["fix-mean"]).exists()
    assert git(co, "ls-files", "-s", "README.md") == index  # the staged version is kept
    assert (co / "README.md").read_text() == "staged, then edited\n"
    assert (co / "megatron/core/__init__.py").read_text() == '"""Edited, not staged."""\n'
    assert (co / "notes.txt").read_text() == "untracked\n"

    r = tool(project, "unapply", co)
    assert r.rc == 1 and "nothing to undo: the last `mcore_fixes apply` was undone already" in r.err
    git(co, "restore", "--staged", "README.md")  # (a committing apply wants nothing staged)
    r = tool(project, "apply", co)  # and forth again
    assert r.rc == 0 and "fix-mean: committed" in r.out


def test_unapply_refuses_what_it_cannot_undo_cleanly(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    r = tool(project, "unapply", co)
    assert r.rc == 1 and "nothing to undo" in r.err and "is not in HEAD's reflog" in r.err

    assert tool(project, "apply", co).rc == 0
    calc = co / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# my edit of a file the series changed\n")
    before = snapshot(co)
    r = tool(project, "unapply", co)
    assert r.rc == 1 and "uncommitted changes in files the series changed" in r.err
    assert snapshot(co) == before

    git(co, "commit", "-qam", "my commit on top of the series")
    r = tool(project, "unapply", co)
    assert r.rc == 1 and "HEAD moved since the series was applied" in r.err
    assert "Traceback" not in r.err and snapshot(co)["head"] == git(co, "rev-parse", "HEAD")
    # The way on, as it says: the series taken out under the user's commit, which stays.
    rebase = r.err.split("`git -C ")[1].split("`")[0]
    assert rebase.startswith(f"{co} rebase --onto "), r.err
    git(co, *rebase.split()[1:])
    assert "# my edit of a file the series changed" in calc.read_text()
    assert git(co, "rev-list", "--count", "HEAD").strip() == "2"


def test_no_commit_apply_prints_its_undo(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    write(co, "README.md", "unrelated work in progress\n")
    r = tool(project, "apply", "--no-commit", co)
    assert r.rc == 0, r.err
    assert f"undo: python -m mcore_fixes unapply {co}\n" in r.out
    assert tool(project, "unapply", co).rc == 0
    status = git(co, "status", "--porcelain", "--untracked-files=all")
    assert status.strip() == "M README.md"  # the series is gone, the user's edit stays


def test_apply_on_a_detached_head_says_how_to_keep_the_commits(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    git(co, "checkout", "-q", "--detach", "core_v0.1.0")
    r = tool(project, "apply", "--dry-run", co)
    assert r.rc == 0, r.err
    assert "HEAD is detached at core_v0.1.0: the commits would be on no branch" in r.out
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert (
        "HEAD is detached at core_v0.1.0: the commits are on no branch; to keep them on one: "
        f"git -C {co} switch -c BRANCH-NAME"
    ) in r.out
    r = tool(project, "unapply", co)  # a detached HEAD goes back too
    assert r.rc == 0 and git(co, "rev-parse", "HEAD").strip() == world.commits["core_v0.1.0"]


def test_unapply_goes_back_to_where_apply_started_whatever_the_reflog_lost(
    world, project, tool, tmp_path
):
    """The start is the old value of the apply's own reflog entry: an entry deleted before it
    (a gap) changes nothing; one that does not lead to the apply's commit is refused."""
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    write(co, "README.md", "my commit\n")
    git(co, "commit", "-qam", "my commit before the apply")
    mine = git(co, "rev-parse", "HEAD").strip()
    assert tool(project, "apply", co).rc == 0
    git(co, "reflog", "delete", "HEAD@{1}")  # the entry of my commit
    r = tool(project, "unapply", co)
    assert r.rc == 0, r.err
    assert f"HEAD back at {mine[:12]}, where `apply` found it" in r.out
    assert git(co, "rev-parse", "HEAD").strip() == mine

    assert tool(project, "apply", co).rc == 0
    unrelated = git(co, "commit-tree", "HEAD^{tree}", "-m", "unrelated").strip()
    log = co / ".git" / "logs" / "HEAD"
    lines = log.read_text().splitlines(keepends=True)
    assert lines[-1].endswith("\tmcore_fixes apply\n")
    lines[-1] = unrelated + lines[-1][len(unrelated) :]
    log.write_text("".join(lines))
    before = snapshot(co)
    r = tool(project, "unapply", co)
    assert r.rc == 1 and "which is not an ancestor of the commit it made" in r.err, r.err
    assert snapshot(co) == before


@pytest.mark.parametrize("applied_before", [False, True])
def test_unapply_after_apply_no_commit_undoes_the_staged_series(
    world, project, tool, tmp_path, applied_before
):
    """`apply --no-commit`, then `unapply`: the series' files back as HEAD has them, in the
    index and the work tree; the user's other changes, staged or not, stay as they were.
    (After an earlier apply that was undone too: HEAD's reflog says "undone already".)"""
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    if applied_before:
        assert tool(project, "apply", co).rc == 0
        assert tool(project, "unapply", co).rc == 0
    write(co, "README.md", "mine, staged\n")
    git(co, "add", "README.md")
    write(co, "notes.txt", "mine, untracked\n")
    before = snapshot(co)
    index = git(co, "ls-files", "-s")
    assert tool(project, "apply", "--no-commit", co).rc == 0
    assert snapshot(co) != before
    r = tool(project, "unapply", co)
    assert r.rc == 0 and "undone already" not in r.out + r.err, r.err
    assert "the series was staged, not committed (`apply --no-commit`): 6 file(s) back" in r.out
    assert "  megatron/core/calc.py\n" in r.out
    assert snapshot(co) == before and git(co, "ls-files", "-s") == index
    r = tool(project, "unapply", co)  # nothing left to undo: said as before
    assert r.rc == 1 and "nothing to undo" in r.err, r.err
    assert snapshot(co) == before


def test_unapply_refuses_a_staged_series_edited_since(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    assert tool(project, "apply", "--no-commit", co).rc == 0
    calc = co / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# my edit after apply --no-commit\n")
    before = snapshot(co)
    r = tool(project, "unapply", co)
    assert r.rc == 1 and "uncommitted changes in files the series touches" in r.err, r.err
    assert "megatron/core/calc.py" in r.err and snapshot(co) == before


HOOK = '#!/bin/sh\necho "$0 ${GIT_INDEX_FILE:-the index}" >> "$HOOK_LOG"\n'


def test_no_hook_of_the_user_runs_on_the_tools_scratch_index(
    world, project, tool, tmp_path, monkeypatch
):
    """A dry run writes no index of the user's: their post-index-change hook never runs
    (in .git/hooks or core.hooksPath); a real apply runs it for the user's index only."""
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    log = tmp_path / "hooks.log"
    monkeypatch.setenv("HOOK_LOG", str(log))
    elsewhere = tmp_path / "my-hooks"
    for hooks in (co / ".git" / "hooks", elsewhere):
        write(hooks, "post-index-change", HOOK)
        (hooks / "post-index-change").chmod(0o755)
    git(co, "update-index", "--refresh")
    log.unlink(missing_ok=True)
    assert tool(project, "apply", "--dry-run", co).rc == 0
    git(co, "config", "core.hooksPath", str(elsewhere))
    assert tool(project, "apply", "--dry-run", co).rc == 0
    assert not log.exists(), log.read_text()
    assert tool(project, "apply", co).rc == 0
    assert "mcore-fixes" not in log.read_text(), log.read_text()
