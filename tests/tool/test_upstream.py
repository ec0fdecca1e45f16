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


UPSTREAM_AUTHOR = {
    "GIT_AUTHOR_NAME": "Upstream Author",
    "GIT_AUTHOR_EMAIL": "author@upstream.example",
    "GIT_AUTHOR_DATE": "2024-05-06T07:08:09+00:00",
}
UPSTREAM_SUBJECT = "Fix mean() of the upstream way (#42)"
DOC = '"""Tiny arithmetic helpers."""\n'


def _upstream_fix(repo: Path, base: str, header: str, double: str = "return 2 * x") -> str:
    """Upstream's own fix of mean() on a side branch from `base` (as dev holds #5835)."""
    from toolworld import CALC_FIXED

    git(repo, "checkout", "-q", "-b", "upstream-dev", base)
    text = CALC_FIXED.replace(DOC, DOC + header).replace("return 2 * x", double)
    write(repo, "megatron/core/calc.py", text)
    msg = f"{UPSTREAM_SUBJECT}\n\nSigned-off-by: Upstream Author <author@upstream.example>\n"
    sha = commit_all(repo, msg, env={**UPSTREAM_AUTHOR, "GIT_COMMITTER_NAME": "Merger",
                                     "GIT_COMMITTER_EMAIL": "m@upstream.example"})  # fmt: skip
    git(repo, "checkout", "-q", "main-work")
    return sha


def _name_upstream_commit(project: Path, sha: str) -> None:
    manifest = project / "patches" / "manifest.toml"
    text = manifest.read_text()
    old = 'id = "fix-mean"\n'
    manifest.write_text(text.replace(old, f'{old}upstream-commit = "{sha}"\n'))


def test_the_fix_starts_with_upstreams_own_commit(project, checkout, tool):
    repo, base = checkout
    sha = _upstream_fix(repo, base, "")
    _name_upstream_commit(project, sha)
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc == 0, res.text
    fix1 = _log(repo, f"{base}..mcore-fixes/fix-1")
    assert [c["s"] for c in fix1] == [UPSTREAM_SUBJECT]  # in place of our fix-mean patch
    assert fix1[0]["author"] == "Upstream Author <author@upstream.example>"  # kept
    assert fix1[0]["committer"] == "Jane Runner <jane@example.com>"
    body = fix1[0]["b"].strip().splitlines()
    assert body[-3:] == [
        "Signed-off-by: Upstream Author <author@upstream.example>",
        f"(cherry picked from commit {sha})",
        "Signed-off-by: Jane Runner <jane@example.com>",
    ]
    # our commits of the other fixes still go on top of it
    fix2 = _log(repo, f"{base}..mcore-fixes/fix-2")
    assert [c["s"] for c in fix2] == [SUBJECTS["join-sep"], UPSTREAM_SUBJECT]
    desc = git(repo, "config", "branch.mcore-fixes/fix-1.description")
    assert f"`git cherry-pick -x {sha[:10]}`" in desc and "in place of our `fix-mean`" in desc


def test_without_the_commit_in_the_checkout_our_patches_are_used(project, checkout, tool):
    repo, base = checkout
    _name_upstream_commit(project, "0123456789abcdef0123456789abcdef01234567")
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "1")
    assert res.rc == 0, res.text
    assert (
        "mcore-fixes/fix-1: the checkout lacks upstream commit 0123456789 (fix-mean): "
        "built from our patches" in res.out
    )
    assert [c["s"] for c in _log(repo, f"{base}..mcore-fixes/fix-1")] == [SUBJECTS["fix-mean"]]


@pytest.mark.parametrize("kind", ["imports", "code"])
def test_a_conflicting_cherry_pick(project, checkout, tool, kind):
    repo, base = checkout
    # the PR's base moved on since upstream's commit branched off: the same lines differ
    if kind == "imports":
        sha = _upstream_fix(repo, base, "\nfrom math import fsum\n")
        calc = (repo / "megatron/core/calc.py").read_text()
        write(
            repo, "megatron/core/calc.py", calc.replace(DOC, DOC + "\nfrom math import isclose\n")
        )
    else:
        sha = _upstream_fix(repo, base, "", double="return x + x")
        calc = (repo / "megatron/core/calc.py").read_text()
        write(repo, "megatron/core/calc.py", calc.replace("return 2 * x", "return x * 2"))
    onto = commit_all(repo, "The base moves on")
    _name_upstream_commit(project, sha)
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", onto, "--fix", "1")
    assert res.rc == 0, res.text
    fix1 = _log(repo, f"{onto}..mcore-fixes/fix-1")
    calc = git(repo, "show", "mcore-fixes/fix-1:megatron/core/calc.py")
    if kind == "imports":  # resolved: both sides' imports, as isort writes them, and noted
        assert [c["s"] for c in fix1] == [UPSTREAM_SUBJECT]
        assert "\nfrom math import fsum, isclose\n" in calc and "<<<<<<<" not in calc
        assert "Conflicts:\n\tmegatron/core/calc.py (import block" in fix1[0]["b"]
        assert f"(cherry picked from commit {sha})" in fix1[0]["b"]
        assert fix1[0]["author"] == "Upstream Author <author@upstream.example>"
    else:  # no safe text resolution: our patch, said so
        assert [c["s"] for c in fix1] == [SUBJECTS["fix-mean"]]
        assert "not cherry-picked (it conflicts with the base beyond import lines in " in res.out
        assert "return x * 2" in calc


def test_merge_imports_is_isort_shaped():
    merged = upstream.merge_imports(
        "from megatron.core.optimizer import HAVE_EMERGING_OPTIMIZERS, ChainedOptimizer\n"
        "from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer\n",
        "from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, "
        "get_megatron_optimizer\n",
    )
    assert merged == (
        "from megatron.core.optimizer import (\n    HAVE_EMERGING_OPTIMIZERS,\n"
        "    ChainedOptimizer,\n    OptimizerConfig,\n    get_megatron_optimizer,\n)\n"
        "from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer\n"
    )
    assert upstream.merge_imports("import os\n", "x = 1\n") is None
