"""`upstream`: one branch per upstream PR in the user's checkout, made by the user's identity."""

from __future__ import annotations

from pathlib import Path

import pytest
from toolworld import SUBJECTS, commit_all, git, snapshot, write

from mcore_fixes import upstream

TEMPLATE = """- [ ] I, the PR author, have personally reviewed every line of this PR.

# What does this PR do?
<!-- Add a one line overview of what this PR aims to accomplish. -->

Linked issue: <!-- e.g. Fixes #1234 / Related to #1234 -->

## Contribution process

- [ ] I have added relevant unit tests
- [ ] I have added relevant functional tests
"""


@pytest.fixture
def checkout(world, tmp_path) -> tuple[Path, str]:
    """A user's clone at core_v0.1.0 plus upstream's PR template, with the user's identity."""
    repo = world.clone(tmp_path / "Megatron-LM", "core_v0.1.0", branch="main-work")
    write(repo, ".github/pull_request_template.md", TEMPLATE)
    base = commit_all(repo, "Add PR template")
    git(repo, "config", "user.name", "Jane Runner")
    git(repo, "config", "user.email", "jane@example.com")
    return repo, base


def _log(repo: Path, ref: str) -> list[dict[str, str]]:
    fmt = "%an <%ae>%x00%cn <%ce>%x00%s%x00%B%x01"
    out = git(repo, "log", f"--format={fmt}", ref)
    entries = []
    for chunk in out.split("\x01"):
        if chunk.strip():
            author, committer, subject, body = chunk.strip("\n").split("\x00")
            entries.append({"author": author, "committer": committer, "s": subject, "b": body})
    return entries


def test_branches_per_fix_with_the_runners_identity(project, checkout, tool):
    repo, base = checkout
    write(repo, "megatron/core/calc.py", "# my uncommitted work\n")
    before = snapshot(repo)
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc == 0, res.text
    assert snapshot(repo) == before  # HEAD, index, work tree, uncommitted work: untouched
    branches = git(repo, "branch", "--format=%(refname:short)").split()
    assert {"mcore-fixes/fix-1", "mcore-fixes/fix-2", "mcore-fixes/fix-3"} <= set(branches)

    # fix 2 requires fix 1's patch: its branch is built on fix 1's
    fix1, fix2 = _log(repo, f"{base}..mcore-fixes/fix-1"), _log(repo, f"{base}..mcore-fixes/fix-2")
    assert [c["s"] for c in fix1] == [SUBJECTS["fix-mean"]]
    assert [c["s"] for c in fix2] == [SUBJECTS["join-sep"], SUBJECTS["fix-mean"]]
    assert git(repo, "merge-base", "mcore-fixes/fix-3", base).strip() == base
    for c in fix1 + fix2 + _log(repo, f"{base}..mcore-fixes/fix-3"):
        assert c["author"] == c["committer"] == "Jane Runner <jane@example.com>"
        trailers = c["b"].strip().splitlines()
        assert trailers[-1] == "Signed-off-by: Jane Runner <jane@example.com>"
        assert not any(t.startswith(("Bug:", "Forwarded:", "Proven-on:")) for t in trailers)
    assert "nothing was pushed" in res.out

    desc = git(repo, "config", "branch.mcore-fixes/fix-1.description")
    assert "# What does this PR do?\nFix off-by-one in mean()" in desc
    assert "Linked issue: Related to https://example.com/issues/fix-mean" in desc
    assert "- [x] I have added relevant unit tests" in desc
    assert "`tests/unit_tests/test_mean.py`" in desc
    assert (
        project / "build" / "upstream" / "mcore-fixes-fix-1.md"
    ).read_text().strip() == desc.strip()
    desc2 = git(repo, "config", "branch.mcore-fixes/fix-2.description")
    assert "Depends on the PR(s) of branch `mcore-fixes/fix-1`" in desc2


def test_again_replaces_only_its_own_branches(project, checkout, tool):
    repo, base = checkout
    assert tool(project, "upstream", "--mcore-repo", repo, "--onto", base).rc == 0
    again = tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "3")
    assert again.rc == 0, again.text
    assert "mcore-fixes/fix-1" not in again.out

    # a branch of that name the tool did not make is refused, and nothing changes
    git(repo, "branch", "-D", "mcore-fixes/fix-3")
    git(repo, "branch", "mcore-fixes/fix-3", base)
    refs = git(repo, "show-ref")
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc != 0
    assert "mcore-fixes/fix-3 exists and was not made by mcore_fixes" in res.err
    assert git(repo, "show-ref") == refs

    # one of its branches that got the user's commits on top is refused too
    git(repo, "branch", "-D", "mcore-fixes/fix-3")
    git(repo, "checkout", "-q", "mcore-fixes/fix-1")
    write(repo, "NOTES.md", "mine\n")
    commit_all(repo, "my own commit")
    git(repo, "checkout", "-q", "main-work")
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc != 0 and "has commits mcore_fixes did not make" in res.err


def test_checked_out_branch_is_refused(project, checkout, tool):
    repo, base = checkout
    assert tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "1").rc == 0
    git(repo, "checkout", "-q", "mcore-fixes/fix-1")
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "1")
    assert res.rc != 0 and "is checked out in" in res.err


def test_no_identity_is_refused(project, checkout, tool, tmp_path, monkeypatch):
    repo, base = checkout
    git(repo, "config", "--unset", "user.name")
    git(repo, "config", "--unset", "user.email")
    empty = tmp_path / "gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    refs = git(repo, "show-ref")
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc != 0
    assert "no git identity is configured" in res.err and "git config --global user.name" in res.err
    assert git(repo, "show-ref") == refs


def test_message_keeps_upstream_trailers_only():
    msg = upstream.parse_message(
        "From 0 Mon Sep 17 00:00:00 2001\n"
        "From: mcore-fixes <mcore-fixes@users.noreply.github.com>\n"
        "Subject: [PATCH] Fix a thing in\n a long subject\n\nBody line.\n\n"
        "Bug: https://github.com/NVIDIA/Megatron-LM/issues/2777\nForwarded: no\n"
        "Proven-on: main\nCo-authored-by: A <a@x>\n"
        "Signed-off-by: mcore-fixes <mcore-fixes@users.noreply.github.com>\n---\n diff\n"
    )
    assert msg.subject == "Fix a thing in a long subject"
    who = upstream.Identity("Jane Runner", "jane@example.com")
    assert upstream.upstream_message(msg, who) == (
        "Fix a thing in a long subject\n\nBody line.\n\n"
        "Co-authored-by: A <a@x>\nSigned-off-by: Jane Runner <jane@example.com>\n"
    )
    assert upstream.linked_issues([msg]) == ["Fixes #2777"]


def test_a_fix_of_several_commits_is_one_branch(project, checkout, tool):
    repo, base = checkout
    manifest = project / "patches" / "manifest.toml"
    text = manifest.read_text()
    manifest.write_text(
        text.replace(
            'id = "weak-test"\nfile = "0003-weak-test.patch"\nfix = 3',
            'id = "weak-test"\nfile = "0003-weak-test.patch"\nfix = 2',
        )
    )
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "2")
    assert res.rc == 0, res.text
    subjects = [c["s"] for c in _log(repo, f"{base}..mcore-fixes/fix-2")]
    assert subjects == [SUBJECTS["weak-test"], SUBJECTS["join-sep"], SUBJECTS["fix-mean"]]
    desc = git(repo, "config", "branch.mcore-fixes/fix-2.description")
    assert "Commits (each applies, imports and passes its tests on its own):" in desc
    assert "mcore-fixes/fix-1" not in git(repo, "branch")  # only what was asked for
