"""`apply`: the series onto a user's Megatron-LM checkout, all or nothing."""

from __future__ import annotations

import os

import pytest
from toolworld import AUTHORS, CALC_FIXED, SUBJECTS, TEST_FILES, git, snapshot, write


def log(repo, n):
    return git(repo, "log", f"-{n}", "--reverse", "--format=%an <%ae>|%aI|%s").splitlines()


def assert_reapply_is_a_noop(tool, project, co, n_patches: int) -> None:
    """Applying again changes nothing and says so for every patch."""
    head = git(co, "rev-parse", "HEAD")
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert "nothing to do" in r.out and r.out.count(": already applied") == n_patches
    assert git(co, "rev-parse", "HEAD") == head


def test_apply_detects_by_version_and_commits_each_patch(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    base = git(co, "rev-parse", "HEAD").strip()
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert "baseline 0.1.0 (megatron/core/package_info.py says 0.1.0; no pinned commit" in r.out
    for pid in ("fix-mean", "join-sep", "weak-test"):
        assert f"  {pid}: committed" in r.out
    assert git(co, "rev-list", "--count", f"{base}..HEAD").strip() == "3"
    assert git(co, "rev-parse", "ORIG_HEAD").strip() == base  # `reset --hard ORIG_HEAD` undoes
    assert git(co, "symbolic-ref", "HEAD").strip() == "refs/heads/work"
    expected = [
        f"{AUTHORS[p][0]} <{AUTHORS[p][1]}>|{AUTHORS[p][2]}|{SUBJECTS[p]}"
        for p in ("fix-mean", "join-sep", "weak-test")
    ]
    assert log(co, 3) == expected
    body = git(co, "log", "-1", "--format=%B", "HEAD~2")
    assert "Signed-off-by: Ada Lovelace <ada@example.com>" in body
    assert "Bug: https://example.com/issues/fix-mean" in body
    assert git(co, "status", "--porcelain").strip() == ""
    assert (co / "megatron/core/calc.py").read_text() == CALC_FIXED
    assert (co / TEST_FILES["fix-mean"]).exists()

    assert_reapply_is_a_noop(tool, project, co, 3)


def test_reapply_when_a_later_patch_rewrites_an_earlier_ones_lines(world, project, tool, tmp_path):
    # A 4th patch edits the line fix-mean wrote: fix-mean alone no longer reverse-applies on
    # the patched checkout, the series does (last patch first), so applying again is a no-op.
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    assert tool(project, "apply", co).rc == 0
    calc = co / "megatron/core/calc.py"
    calc.write_text(CALC_FIXED.replace("total / len(values)", "total / max(len(values), 1)"))
    git(co, "commit", "-q", "-am", "Guard mean() against an empty sequence")
    text = git(co, "format-patch", "-1", "--stdout", "--zero-commit", "--no-signature")
    (project / "patches/0004-mean-guard.patch").write_text(text)
    with (project / "patches/manifest.toml").open("r+") as f:
        manifest = f.read()
        f.seek(0)
        entry = '[[patch]]\nid = "mean-guard"\nfile = "0004-mean-guard.patch"\nfix = 1\n\n'
        f.write(manifest.replace("[baselines.", entry + "[baselines.", 1))
    fresh = world.clone(tmp_path / "fresh", "core_v0.1.0")
    r = tool(project, "apply", fresh)
    assert r.rc == 0, r.err
    assert "  mean-guard: committed" in r.out
    assert_reapply_is_a_noop(tool, project, fresh, 4)


def test_apply_to_linked_worktree_detects_pinned_commit(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    wt = tmp_path / "wt"
    git(co, "worktree", "add", "-q", "-b", "wt-branch", str(wt), "core_v0.1.1")
    main_head = git(co, "rev-parse", "HEAD")
    r = tool(project, "apply", wt / "megatron")  # any directory inside the checkout
    assert r.rc == 0, r.err
    assert "baseline core_v0.1.1 (HEAD is the pinned commit of core_v0.1.1)" in r.out
    assert "weak-test: absent on core_v0.1.1" in r.out
    assert log(wt, 2) == [
        f"{AUTHORS[p][0]} <{AUTHORS[p][1]}>|{AUTHORS[p][2]}|{SUBJECTS[p]}"
        for p in ("fix-mean", "join-sep")
    ]
    assert git(wt, "rev-parse", "HEAD~2").strip() == world.commits["core_v0.1.1"]
    assert git(co, "rev-parse", "HEAD") == main_head  # the main work tree is not touched
    assert git(wt, "status", "--porcelain").strip() == ""
    assert not (wt / "megatron/core/constants.py").exists()


def test_apply_partly_upstream(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.2.0")
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert "fix-mean: already applied" in r.out
    assert "join-sep: committed" in r.out and "weak-test: committed" in r.out
    assert "nothing to do" not in r.out
    assert git(co, "rev-list", "--count", "core_v0.2.0..HEAD").strip() == "2"


def test_apply_no_commit(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    head = git(co, "rev-parse", "HEAD")
    r = tool(project, "apply", "--no-commit", co)
    assert r.rc == 0, r.err
    assert r.out.count("staged in the index and work tree (not committed)") == 3
    assert git(co, "rev-parse", "HEAD") == head
    status = git(co, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert "M  megatron/core/calc.py" in status and "M  megatron/core/util.py" in status
    assert f"A  {TEST_FILES['fix-mean']}" in status  # the new tests are tracked
    assert (co / "megatron/core/calc.py").read_text() == CALC_FIXED
    before = snapshot(co)
    r = tool(project, "apply", "--no-commit", co)
    assert r.rc == 0 and "nothing to do" in r.out
    assert r.out.count("already applied (staged, not committed)") == 3

    # A committing apply after --no-commit neither claims "already applied" nor commits.
    r = tool(project, "apply", co)
    assert r.rc == 1
    assert "applied but not committed" in r.err and "git commit" in r.err
    assert snapshot(co) == before
    git(co, "commit", "-qm", "the series, squashed")
    r = tool(project, "apply", co)
    assert r.rc == 0 and "nothing to do" in r.out


def test_apply_refuses_dirty_touched_file(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    calc = co / "megatron/core/calc.py"
    calc.write_text(calc.read_text() + "# work in progress\n")
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 1
    assert "uncommitted changes" in r.err and "megatron/core/calc.py" in r.err
    assert "nothing was changed" in r.err
    assert snapshot(co) == before
    assert calc.read_text().endswith("# work in progress\n")


def test_apply_refuses_untracked_file_in_the_way(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    write(co, TEST_FILES["join-sep"], "# mine\n")
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 1 and TEST_FILES["join-sep"] in r.err
    assert snapshot(co) == before


def test_apply_refuses_staged_changes(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    write(co, "README.md", "staged\n")
    git(co, "add", "README.md")
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 1 and "staged changes" in r.err
    assert snapshot(co) == before


def test_apply_conflict_leaves_checkout_exactly_as_before(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.3.0")
    write(co, "notes.txt", "untracked work\n")
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 1
    msg = r.err.strip()
    assert len(msg.splitlines()) == 1
    assert "patch join-sep (0002-join-sep.patch)" in msg
    assert "megatron/core/util.py" in msg and "left unchanged" in msg
    assert snapshot(co) == before
    assert not (co / ".git" / "rebase-apply").exists()


def test_apply_keeps_unrelated_uncommitted_work(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    write(co, "README.md", "my unrelated edit\n")
    write(co, "megatron/core/__init__.py", '"""Locally edited."""\n')
    write(co, "scratch/notes.txt", "untracked\n")
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert git(co, "rev-list", "--count", "core_v0.1.0..HEAD").strip() == "3"
    status = sorted(git(co, "status", "--porcelain", "--untracked-files=all").splitlines())
    assert status == [" M README.md", " M megatron/core/__init__.py", "?? scratch/notes.txt"]
    assert (co / "README.md").read_text() == "my unrelated edit\n"
    assert (co / "scratch/notes.txt").read_text() == "untracked\n"
    # The commits carry only the series' files.
    files = git(co, "diff", "--name-only", "core_v0.1.0", "HEAD").split()
    assert "README.md" not in files and "megatron/core/__init__.py" not in files


def test_apply_baseline_override(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.1")
    git(co, "commit", "-q", "--allow-empty", "-m", "local")  # HEAD no longer the pin
    r = tool(project, "apply", "--no-commit", co)  # but it descends from it
    assert r.rc == 0, r.err
    assert "baseline core_v0.1.1 (HEAD is 1 commit(s) after the pinned commit" in r.out
    git(co, "reset", "-q", "--hard")
    git(co, "clean", "-qfd")
    # History that holds no pinned commit (here an orphan branch), and 0.1.1rc0 is no
    # baseline's version: nothing matches.
    git(co, "checkout", "-q", "--orphan", "flat")
    git(co, "commit", "-q", "-m", "flattened")
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 2
    msg = r.err.strip()
    assert len(msg.splitlines()) == 1
    assert "matches no baseline" in msg and "0.1.1rc0" in msg and "--baseline" in msg
    assert snapshot(co) == before
    r = tool(project, "apply", "--baseline", "core_v0.1.1", co)
    assert r.rc == 0, r.err
    assert "chosen with --baseline" in r.out
    assert git(co, "rev-list", "--count", "HEAD").strip() == "3"


def test_apply_not_a_checkout(project, tool, tmp_path):
    r = tool(project, "apply", tmp_path / "missing")
    assert r.rc == 2 and "does not exist" in r.err
    (tmp_path / "plain").mkdir()
    r = tool(project, "apply", tmp_path / "plain")
    assert r.rc == 2 and "not a git work tree" in r.err


def test_apply_not_megatron(world, project, tool, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    write(other, "x.txt", "x\n")
    git(other, "add", "x.txt")
    git(other, "commit", "-qm", "x")
    r = tool(project, "apply", other)
    assert r.rc == 2 and "not a Megatron-LM checkout" in r.err


def test_apply_refuses_during_am_in_progress(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    (co / ".git" / "rebase-apply").mkdir()
    r = tool(project, "apply", co)
    assert r.rc == 1 and "in progress" in r.err


def test_apply_refuses_during_am_in_linked_worktree(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    wt = tmp_path / "wt"
    git(co, "worktree", "add", "-q", "-b", "wt-branch", str(wt), "core_v0.1.0")
    gitdir = git(wt, "rev-parse", "--absolute-git-dir").strip()
    (tmp_path / gitdir / "rebase-apply").mkdir()
    before = snapshot(wt)
    r = tool(project, "apply", wt)
    assert r.rc == 1 and "in progress" in r.err
    assert snapshot(wt) == before


def test_apply_refuses_during_cherry_pick(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    (co / ".git" / "CHERRY_PICK_HEAD").write_text(git(co, "rev-parse", "HEAD"))
    before = snapshot(co)
    r = tool(project, "apply", co)
    assert r.rc == 1 and "cherry-pick" in r.err and "in progress" in r.err
    assert snapshot(co) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_apply_read_only_checkout(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    before = snapshot(co)
    for path in [co, *co.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        r = tool(project, "apply", co)
    finally:
        for path in [co, *co.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert r.rc == 2 and "is not writable" in r.err and "fix-mean" not in r.err
    assert snapshot(co) == before


def test_apply_to_sparse_and_shallow_clones(world, project, tool, tmp_path):
    co = world.clone(tmp_path / "co", "core_v0.1.0")
    git(co, "sparse-checkout", "set", "megatron")  # the patches' tests stay out of the tree
    r = tool(project, "apply", co)
    assert r.rc == 0 and r.out.count(": committed") == 3, r.err
    assert git(co, "status", "--porcelain").strip() == "" and not (co / "tests").exists()
    assert TEST_FILES["fix-mean"] in git(co, "ls-files")
    shallow = tmp_path / "shallow"
    url = f"file://{world.upstream}"
    git(tmp_path, "clone", "-q", "--depth", "1", "-b", "core_v0.1.0", url, str(shallow))
    r = tool(project, "apply", shallow)
    assert r.rc == 0 and r.out.count(": committed") == 3, r.err
    assert git(shallow, "rev-list", "--count", "HEAD").strip() == "4"
