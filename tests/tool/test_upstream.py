"""`upstream`: one branch per upstream PR in the user's checkout, made by the user's identity."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from test_interrupts import start, wait_reached, wrapped_env
from toolworld import SUBJECTS, add_git_baseline, commit_all, git, run_module, snapshot, write

from mcore_fixes.maint import upstream

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
        assert [t for t in trailers if t.startswith("Signed-off-by:")] == [trailers[-1]]
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
        "Proven-on: main\nCo-authored-by: A <a@x>\nSigned-off-by: Ada Lovelace <ada@example.com>\n"
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
        assert (
            f"not cherry-picked (it conflicts with {onto[:10]} beyond import lines in " in res.out
        )
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


# --- [Main] and [Dev]: both of upstream's branches, and the upstream fixes the series carries ---

EXTRA_SUBJECT = "Fix upper() of non-strings (#77)"
EXTRA = '"""Extra helpers."""\n\n\ndef upper_any(x):\n    return str(x).upper()\n'
TEST_EXTRA = (
    "from megatron.core.extra import upper_any\n\n\n"
    "def test_upper_any():\n    assert upper_any(1) == '1'\n"
)
ORIGIN = "Origin: upstream, https://github.com/NVIDIA/Megatron-LM/pull/77"


def _carried_patch(repo: Path, base: str, name: str) -> str:
    """The series' patch of upstream commit `name` made on `base`: upstream's author and
    message, plus our DEP-3 `Origin:` (as the series carries upstream's fixes)."""
    from toolworld import FORMAT_PATCH

    git(repo, "checkout", "-q", "--detach", base)
    write(repo, "megatron/core/extra.py", EXTRA)
    write(repo, "tests/unit_tests/test_extra.py", TEST_EXTRA)
    commit_all(
        repo, f"{EXTRA_SUBJECT}\n\nWhy, in upstream's words.\n\n{ORIGIN}\n", env=UPSTREAM_AUTHOR
    )
    text = git(repo, *FORMAT_PATCH)
    git(repo, "checkout", "-q", "main-work")
    return text


def _paired(project: Path, repo: Path, base: str, dev_has_extra: bool = False) -> dict[str, str]:
    """Upstream's main and dev in the toy: dev holds upstream's own fix of mean() that main
    lacks (as dev holds #5835), main holds upstream's fix #77 that dev lacks (as main holds
    #5077), which the series carries as its first patch (fix 5). The manifest's canonical
    baseline is main. `dev_has_extra`: dev has its own extra.py, so #77 conflicts there and
    the series carries a backport for dev."""
    dev = _upstream_fix(repo, base, "")
    git(repo, "checkout", "-q", "-b", "upstream-main", base)
    write(repo, "megatron/core/extra.py", EXTRA)
    write(repo, "tests/unit_tests/test_extra.py", TEST_EXTRA)
    main = commit_all(repo, f"{EXTRA_SUBJECT}\n\nWhy, in upstream's words.\n", env=UPSTREAM_AUTHOR)
    git(repo, "checkout", "-q", "main-work")
    patches = project / "patches"
    (patches / "0000a-extra.patch").write_text(_carried_patch(repo, base, "extra"))
    manifest = patches / "manifest.toml"
    text = manifest.read_text().replace('canonical = "0.1.0"', 'canonical = "main"')
    entry = '[[patch]]\nid = "extra"\nfile = "0000a-extra.patch"\nfix = 5\n'
    entry += f'upstream-commit = "{main}"\n\n'
    text = text.replace("[[patch]]", entry + "[[patch]]", 1)
    manifest.write_text(
        text.replace('id = "fix-mean"\n', f'id = "fix-mean"\nupstream-commit = "{dev}"\n')
    )
    variants: dict[str, str] = {}
    if dev_has_extra:
        git(repo, "checkout", "-q", "upstream-dev")
        write(repo, "megatron/core/extra.py", '"""Extra helpers, dev\'s own."""\n')
        dev = commit_all(repo, "dev's own extra module")
        (patches / "dev").mkdir()
        (patches / "dev" / "0000a-extra.patch").write_text(_carried_patch(repo, dev, "extra"))
        variants = {"extra": "dev/0000a-extra.patch"}
    add_git_baseline(project, "main", main, "0.1.0")
    add_git_baseline(
        project,
        "dev",
        dev,
        "0.1.0",
        fixed_upstream={"fix-mean": f"{dev[:10]} (#42)"},
        variants=variants,
        backports={"extra": "dev has its own extra.py"} if variants else {},
    )
    return {"main": main, "dev": dev}


def _subjects(repo: Path, spec: str) -> list[str]:
    return [c["s"] for c in _log(repo, spec)]


def test_both_branches_each_with_what_it_lacks(project, checkout, tool):
    """[Main] and [Dev] branches by default: each cherry-picks upstream's commit that only the
    other branch has (author kept), and re-adds none that it has."""
    repo, base = checkout
    pins = _paired(project, repo, base)
    main, dev = pins["main"], pins["dev"]
    (project / "patches" / "pr").mkdir()
    (project / "patches" / "pr" / "fix-2.md").write_text(
        "Title: Let join_names() take any separator\n\n## Evidence\n\nmeasured: 3 of 3 joins\n"
    )
    (project / "patches" / "pr" / "join-sep.md").write_text("join-sep: proven on 0.1.0\n")
    res = tool(project, "upstream", "--mcore-repo", repo)
    assert res.rc == 0, res.text
    assert "[Main] " in res.out and "[Dev] " in res.out

    # main lacks upstream's fix of mean() (dev has it): fix 1 is its cherry-pick, author kept
    fix1 = _log(repo, f"{main}..mcore-fixes/fix-1")
    assert [c["s"] for c in fix1] == [UPSTREAM_SUBJECT]
    assert fix1[0]["author"] == "Upstream Author <author@upstream.example>"
    assert f"(cherry picked from commit {dev})" in fix1[0]["b"]
    assert _subjects(repo, f"{main}..mcore-fixes/fix-2") == [SUBJECTS["join-sep"], UPSTREAM_SUBJECT]
    # main has #77: nothing to send there
    assert "mcore-fixes/cherry-pick-77: no branch: upstream commit" in res.out
    assert "is already on main" in res.out
    assert git(repo, "branch", "--list", "mcore-fixes/cherry-pick-77").strip() == ""

    # dev has upstream's mean() fix: not re-added; fix 1 has nothing else: no branch
    assert "mcore-fixes/dev/fix-1: no branch: nothing left to send on dev" in res.out
    assert git(repo, "branch", "--list", "mcore-fixes/dev/fix-1").strip() == ""
    assert _subjects(repo, f"{dev}..mcore-fixes/dev/fix-2") == [SUBJECTS["join-sep"]]
    assert git(repo, "rev-parse", "mcore-fixes/dev/fix-2~1").strip() == dev
    # dev lacks #77: its [Dev] twin, `git cherry-pick -x`, author kept, the sender's sign-off
    (pick,) = _log(repo, f"{dev}..mcore-fixes/dev/cherry-pick-77")
    assert (
        pick["s"] == EXTRA_SUBJECT and pick["author"] == "Upstream Author <author@upstream.example>"
    )
    assert pick["committer"] == "Jane Runner <jane@example.com>"
    assert pick["b"].strip().splitlines()[-2:] == [
        f"(cherry picked from commit {main})",
        "Signed-off-by: Jane Runner <jane@example.com>",
    ]

    desc = git(repo, "config", "branch.mcore-fixes/dev/cherry-pick-77.description")
    assert desc.startswith(f"[Dev] {EXTRA_SUBJECT}\n\n")
    assert (
        f"[Dev] cherry-pick of upstream's own commit {main[:10]}" in desc
        and "which main has and dev lacks" in desc
    )
    dev2 = git(repo, "config", "branch.mcore-fixes/dev/fix-2.description")
    assert dev2.startswith("[Dev] Let join_names() take any separator\n\n")
    assert "dev already has upstream's own fix" not in dev2  # fix 2 names no upstream commit
    assert "measured: 3 of 3 joins" in dev2 and "join-sep: proven on 0.1.0" in dev2
    assert "Twin PR(s): [Main] `mcore-fixes/fix-2`" in dev2
    assert (project / "build/upstream/mcore-fixes-dev-fix-2.md").read_text().strip() == dev2.strip()
    main2 = git(repo, "config", "branch.mcore-fixes/fix-2.description")
    assert main2.startswith("[Main] Let join_names() take any separator\n\n")


def test_a_carried_fix_only_dev_has_is_its_main_twin(project, checkout, tool):
    """The [Main] twin of a carried fix that only dev has (as dev holds #5213): `git
    cherry-pick -x` of dev's commit on main, author kept, no [Dev] branch. Its message is
    trailers only (a squash merge): the description repeats no empty section for it."""
    repo, base = checkout
    git(repo, "checkout", "-q", "-b", "upstream-dev", base)
    write(repo, "megatron/core/extra.py", EXTRA)
    write(repo, "tests/unit_tests/test_extra.py", TEST_EXTRA)
    signed = "Signed-off-by: Upstream Author <author@upstream.example>"
    dev = commit_all(repo, f"{EXTRA_SUBJECT}\n\n{signed}\n", env=UPSTREAM_AUTHOR)
    git(repo, "checkout", "-q", "main-work")
    patches = project / "patches"
    (patches / "0000a-extra.patch").write_text(_carried_patch(repo, base, "extra"))
    manifest = patches / "manifest.toml"
    text = manifest.read_text().replace('canonical = "0.1.0"', 'canonical = "main"')
    entry = '[[patch]]\nid = "extra"\nfile = "0000a-extra.patch"\nfix = 5\n'
    entry += f'upstream-commit = "{dev}"\n\n'
    manifest.write_text(text.replace("[[patch]]", entry + "[[patch]]", 1))
    add_git_baseline(project, "main", base, "0.1.0")
    add_git_baseline(project, "dev", dev, "0.1.0")
    (patches / "pr").mkdir()
    (patches / "pr" / "extra.md").write_text("# [Main] twin of #77\n\nmeasured: 2 of 2\n")
    res = tool(project, "upstream", "--mcore-repo", repo)
    assert res.rc == 0, res.text

    (pick,) = _log(repo, f"{base}..mcore-fixes/cherry-pick-77")
    assert pick["s"] == EXTRA_SUBJECT
    assert pick["author"] == "Upstream Author <author@upstream.example>"
    assert pick["b"].strip().splitlines()[-3:] == [
        signed,
        f"(cherry picked from commit {dev})",
        "Signed-off-by: Jane Runner <jane@example.com>",
    ]
    assert "mcore-fixes/dev/cherry-pick-77: no branch: upstream commit" in res.out
    assert git(repo, "branch", "--list", "mcore-fixes/dev/cherry-pick-77").strip() == ""

    desc = git(repo, "config", "branch.mcore-fixes/cherry-pick-77.description")
    assert desc.startswith(f"[Main] {EXTRA_SUBJECT}\n\n")
    assert f"[Main] cherry-pick of upstream's own commit {dev[:10]}" in desc
    assert "which dev has and main lacks: `git cherry-pick -x" in desc
    assert f"### {EXTRA_SUBJECT}" not in desc  # no heading over an empty body
    assert "# [Main] twin of #77\n\nmeasured: 2 of 2" in desc


def test_dev_alone_with_onto_its_pinned_commit(project, checkout, tool):
    """`--onto` dev's pin: its baseline, its fixed-upstream patches left out, as `apply` does."""
    repo, base = checkout
    pins = _paired(project, repo, base)
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", "upstream-dev")
    assert res.rc == 0, res.text
    assert f"[Dev] {pins['dev'][:10]}: dev (HEAD is the pinned commit of dev)" in res.out
    assert _subjects(repo, f"{pins['dev']}..mcore-fixes/dev/fix-2") == [SUBJECTS["join-sep"]]
    assert git(repo, "branch", "--list", "mcore-fixes/fix-*").strip() == ""


def test_a_carried_commit_that_conflicts_is_our_backport(project, checkout, tool):
    repo, base = checkout
    pins = _paired(project, repo, base, dev_has_extra=True)
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", pins["dev"])
    assert res.rc == 0, res.text
    assert (
        "not cherry-picked (it conflicts with" in res.out
        and "the series' backport for dev" in res.out
    )
    (pick,) = _log(repo, f"{pins['dev']}..mcore-fixes/dev/cherry-pick-77")
    assert (
        pick["s"] == EXTRA_SUBJECT and pick["author"] == "Upstream Author <author@upstream.example>"
    )
    body = pick["b"]
    assert (
        f"(cherry picked from commit {pins['main']})\n\nConflicts:\n\tmegatron/core/extra.py\n"
        in body
    )
    resolved = "Resolved as mcore-fixes' backport for dev (patches/dev/0000a-extra.patch)"
    assert f"{resolved}: dev has its own extra.py" in body
    assert ORIGIN not in body and body.strip().endswith(
        "Signed-off-by: Jane Runner <jane@example.com>"
    )
    assert git(repo, "show", "mcore-fixes/dev/cherry-pick-77:megatron/core/extra.py") == EXTRA


def test_an_open_pr_is_not_sent(project, checkout, tool):
    """A carried commit on no branch (an open PR's head): its author's to send, not ours."""
    repo, base = checkout
    pins = _paired(project, repo, base)
    git(repo, "update-ref", "refs/pull/77/head", pins["main"])
    git(repo, "branch", "-D", "upstream-main")
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", pins["dev"])
    assert res.rc == 0, res.text
    assert "mcore-fixes/dev/cherry-pick-77: no branch:" in res.out and "(an open PR)" in res.out
    assert git(repo, "branch", "--list", "mcore-fixes/dev/cherry-pick-77").strip() == ""


# --- branches made all at once, or not at all; built on what exists -----------------------------


def _records(repo: Path) -> str:
    proc = git(repo, "config", "--get-regexp", r"^branch\.mcore-fixes/", check=False)
    return proc


@pytest.mark.parametrize("clash", ["mcore-fixes/fix-1/wip", "mcore-fixes"])
def test_a_branch_in_the_way_of_a_name_changes_nothing(project, checkout, tool, clash):
    repo, base = checkout
    git(repo, "branch", clash, base)
    refs, records = git(repo, "show-ref"), _records(repo)
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc == 1 and "Traceback" not in res.err
    assert f"branch {clash} exists, so git cannot make branch mcore-fixes/fix-1" in res.err
    assert "nothing was changed" in res.err and len(res.err.strip().splitlines()) == 1
    assert git(repo, "show-ref") == refs and _records(repo) == records
    git(repo, "branch", "-m", clash, "my-wip")
    again = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert again.rc == 0, again.text


def test_a_refused_transaction_leaves_no_records(project, checkout, tool):
    """The checkout's own reference-transaction hook refuses: its reason shown, nothing kept."""
    repo, base = checkout
    hook = repo / ".git" / "hooks" / "reference-transaction"
    refuse = '{ echo "policy: no mcore-fixes here" >&2; exit 1; }'
    hook.write_text(f'#!/bin/sh\n[ "$1" = prepared ] && {refuse}\nexit 0\n')
    hook.chmod(0o755)
    refs, records = git(repo, "show-ref"), _records(repo)
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc == 1 and "policy: no mcore-fixes here" in res.err, res.text
    assert git(repo, "show-ref") == refs and _records(repo) == records


def test_a_fix_is_built_on_the_existing_branch_it_needs(project, checkout, tool):
    repo, base = checkout
    assert tool(project, "upstream", "--mcore-repo", repo, "--onto", base).rc == 0
    tips = {f: git(repo, "rev-parse", f"mcore-fixes/fix-{f}").strip() for f in (1, 2, 3)}
    time.sleep(1.1)  # a rebuild would have another commit date, so another id
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "2")
    assert res.rc == 0, res.text
    assert f"on mcore-fixes/fix-1 ({tips[1][:10]})" in res.out
    assert git(repo, "rev-parse", "mcore-fixes/fix-2~1").strip() == tips[1]
    assert "unchanged" in res.out and git(repo, "rev-parse", "mcore-fixes/fix-2").strip() == tips[2]
    again = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert again.rc == 0 and again.out.count("unchanged, tip") == 3
    assert {f: git(repo, "rev-parse", f"mcore-fixes/fix-{f}").strip() for f in (1, 2, 3)} == tips

    # fix 1's patch changed since its branch was made: said exactly what fix 2 is built on
    patch = project / "patches" / "0001-fix-mean.patch"
    patch.write_text(patch.read_text().replace("Why fix-mean is needed", "Why fix-mean is wanted"))
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "2")
    assert res.rc == 0, res.text
    fresh = git(repo, "rev-parse", "mcore-fixes/fix-2~1").strip()
    assert fresh != tips[1] and git(repo, "rev-parse", "mcore-fixes/fix-1").strip() == tips[1]
    assert (
        f"on a fresh build of fix-1 ({fresh[:10]}), not on branch mcore-fixes/fix-1 (made from "
        "other inputs; `--fix 1` makes that branch)" in res.out
    )


# --- the scratch clone: the user's hooks and config stay out; nothing is left in $TMPDIR -----


def test_a_template_that_is_not_utf8(project, checkout, tool):
    repo, _ = checkout
    (repo / ".github" / "pull_request_template.md").write_bytes(TEMPLATE.encode() + b"caf\xe9\n")
    base = commit_all(repo, "A template in Latin-1")
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base, "--fix", "1")
    assert res.rc == 0, res.text
    assert ".github/pull_request_template.md at " in res.out and "is not UTF-8" in res.out
    assert "caf\ufffd" in git(repo, "config", "branch.mcore-fixes/fix-1.description")


def test_the_users_global_hooks_do_not_run_in_the_scratch_clone(
    project, checkout, tool, tmp_path, monkeypatch
):
    repo, base = checkout
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in (
        "pre-commit",
        "prepare-commit-msg",
        "commit-msg",
        "post-commit",
        "post-checkout",
        "pre-applypatch",
        "applypatch-msg",
        "post-applypatch",
        "post-rewrite",
    ):
        (hooks / name).write_text(
            f'#!/bin/sh\ntouch "{tmp_path}/ran-{name}"\necho "{name} says no" >&2\nexit 1\n'
        )
        (hooks / name).chmod(0o755)
    config = tmp_path / "gitconfig"
    config.write_text(
        Path(os.environ["GIT_CONFIG_GLOBAL"]).read_text() + f"[core]\n\thooksPath = {hooks}\n"
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    res = tool(project, "upstream", "--mcore-repo", repo, "--onto", base)
    assert res.rc == 0, res.text
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == []


def _scratch_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob(f"{upstream.SCRATCH_PREFIX}*"))


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_run_leaves_no_scratch_clone(project, checkout, tmp_path, how):
    repo, base = checkout
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**wrapped_env(tmp_path, "cherry-pick"), "TMPDIR": str(tmp)}
    proc = start(project, "upstream", "--mcore-repo", repo, "--onto", base, env=env)
    wait_reached(env, proc)
    assert len(_scratch_dirs(tmp)) == 1
    os.killpg(proc.pid, how)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert _scratch_dirs(tmp) == []


def test_the_scratch_clone_of_a_killed_run_is_removed_by_the_next(project, checkout, tmp_path):
    repo, base = checkout
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    alive = tmp / f"{upstream.SCRATCH_PREFIX}alive"  # a run still going: kept
    alive.mkdir()
    (alive / upstream.SCRATCH_MARKER).write_text(f"{os.getpid()} {socket.gethostname()}\n")
    foreign = tmp / f"{upstream.SCRATCH_PREFIX}unmarked"  # not provably ours: kept
    foreign.mkdir()
    env = {**wrapped_env(tmp_path, "cherry-pick"), "TMPDIR": str(tmp)}
    proc = start(project, "upstream", "--mcore-repo", repo, "--onto", base, env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_scratch_dirs(tmp)) == 3
    r = run_module(
        project, "upstream", "--mcore-repo", repo, "--onto", base, env={**env, "STOP_AT": "none"}
    )
    assert r.rc == 0, r.err
    assert _scratch_dirs(tmp) == sorted([alive.name, foreign.name])


FIRST_RECORD = "config branch.mcore-fixes/fix-1.description"  # the first write after the fetch


@pytest.mark.parametrize("stop_at", [FIRST_RECORD, "update-ref -m"])
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_while_writing_the_branches(project, checkout, tmp_path, stop_at, how):
    """Ctrl-C or a kill between the fetch and the last record: every branch there is one the
    tool recorded, and the next run goes on (it used to refuse them as not its own)."""
    repo, base = checkout
    env = wrapped_env(tmp_path, stop_at, stop_for=1 if how == signal.SIGINT else 30)
    env["REACHED"] = str(tmp_path / "reached")  # stop_at has a "/"
    proc = start(project, "upstream", "--mcore-repo", repo, "--onto", base, env=env)
    wait_reached(env, proc)
    os.killpg(proc.pid, how)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    for name in git(repo, "branch", "--list", "mcore-fixes/*", "--format=%(refname:short)").split():
        assert git(repo, "config", f"branch.{name}.{upstream.RECORD_KEY}", check=False).strip(), (
            name
        )
    r = run_module(
        project, "upstream", "--mcore-repo", repo, "--onto", base, env={**env, "STOP_AT": "none"}
    )
    assert r.rc == 0, r.err
    for f in (1, 2, 3):
        tip = git(repo, "rev-parse", f"mcore-fixes/fix-{f}").strip()
        assert (
            git(repo, "config", f"branch.mcore-fixes/fix-{f}.{upstream.RECORD_KEY}").strip() == tip
        )
    assert upstream.PREVIOUS_KEY.lower() not in _records(repo).lower()
