"""Release tags and their release branches: a checkout there takes the tag's git baseline
(its variants, tests included), never the PyPI baseline of the same version."""

from __future__ import annotations

import os

from toolworld import FORMAT_PATCH, commit_all, git, package_info, write

from mcore_fixes.series import left_out_lines

TAG = '\n[baselines."core_v0.1.5"]\nsource = "git"\nref = "core_v0.1.5"\ncommit = "{commit}"\n'
TAG += 'version = "0.1.5"\n'

PYPI = '\n[baselines."0.1.5"]\nsource = "pypi"\nversion = "0.1.5"\nsha256 = "{sha}"\n'
PYPI += 'same-code-as = "core_v0.1.5"\n'


def release_branch(world, project, tmp_path) -> dict[str, str]:
    """core_r0.1.0 off core_v0.1.0: r1 (says 0.1.5), r2 (tag core_v0.1.5, pinned), r3 (a
    downstream pin after the tag); and r0, a commit before the bump (says 0.1.4)."""
    up = tmp_path / "up.git"
    git(world.base, "clone", "-q", "--bare", str(world.upstream), str(up))
    work = tmp_path / "upwork"
    git(world.base, "clone", "-q", str(up), str(work))
    git(work, "checkout", "-q", "-b", "core_r0.1.0", "core_v0.1.0")
    commits = {}
    write(work, "megatron/core/package_info.py", package_info(0, 1, 4))
    commits["r0"] = commit_all(work, "Bump to 0.1.4")
    write(work, "megatron/core/package_info.py", package_info(0, 1, 5))
    commits["r1"] = commit_all(work, "Bump to 0.1.5")
    write(work, "README.md", "Release notes of 0.1.5\n")
    commits["r2"] = commit_all(work, "Release 0.1.5")
    git(work, "tag", "core_v0.1.5")
    write(work, "README.md", "A backport after 0.1.5\n")
    commits["r3"] = commit_all(work, "Backport after the release")
    git(work, "push", "-q", "origin", "core_r0.1.0", "core_v0.1.5")
    with (project / "patches/manifest.toml").open("a") as f:
        f.write(TAG.format(commit=commits["r2"]) + PYPI.format(sha="a" * 64))
    commits["up"] = str(up)
    return commits


def test_release_tag_and_branch_commits_take_the_tag_baseline(world, project, tool, tmp_path):
    c = release_branch(world, project, tmp_path)
    expected = {
        "r2": "baseline core_v0.1.5 (HEAD is the pinned commit of core_v0.1.5)",
        "r3": "baseline core_v0.1.5 (HEAD is 1 commit(s) after the pinned commit of core_v0.1.5)",
        "r1": "baseline core_v0.1.5 (megatron/core/package_info.py says 0.1.5",
        "r0": "baseline core_v0.1.5 (HEAD is 2 commit(s) before the pinned commit of core_v0.1.5)",
    }
    for name, line in expected.items():
        co = tmp_path / f"co-{name}"
        git(world.base, "clone", "-q", c["up"], str(co))
        git(co, "checkout", "-q", "-B", "core_r0.1.0", c[name])
        git(co, "branch", "-q", "--set-upstream-to=origin/core_r0.1.0")
        r = tool(project, "apply", co)
        assert r.rc == 0, r.err
        assert line in r.out, r.out
        assert r.out.count(": committed") == 3, r.out
        assert "baseline 0.1.5" not in r.out


def test_left_out_test_section_is_said_once_per_section(world, project, tool, tmp_path):
    """A tag whose test file differs from the one a test section was written against: the code
    applies, the section is left out with why (apply, vendor, status), never silently."""
    c = release_branch(world, project, tmp_path)
    co = tmp_path / "co"
    git(world.base, "clone", "-q", c["up"], str(co))
    git(co, "checkout", "-q", "-b", "pin", c["r2"])
    # fix-mean's test file exists here already, with other content: its section cannot land
    write(co, "tests/unit_tests/test_mean.py", "def test_other():\n    pass\n")
    git(co, "add", "-A")
    git(co, "commit", "-qm", "upstream has its own test_mean.py")
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    lines = [ln.strip() for ln in r.out.splitlines() if "skipped its upstream test" in ln]
    assert lines == [
        "fix-mean: kept the fix, skipped its upstream test in tests/unit_tests/test_mean.py: "
        "it creates tests/unit_tests/test_mean.py, which exists here"
    ], r.out
    assert "fix-mean: committed" in r.out
    assert (co / "tests/unit_tests/test_mean.py").read_text() == "def test_other():\n    pass\n"
    assert "def mean" in (co / "megatron/core/calc.py").read_text()
    # again: nothing to do (the left-out section stays out)
    again = tool(project, "apply", co)
    assert again.rc == 0 and "nothing to do" in again.out, again.out + again.err


def graft_world(world, tmp_path):
    """An old tag `old` whose test file differs near (not at) the lines the canonical patch's
    test section adds, and its code-only variant; returns (project, upstream)."""
    up = tmp_path / "up.git"
    git(world.base, "clone", "-q", "--bare", str(world.upstream), str(up))
    work = tmp_path / "upwork"
    git(world.base, "clone", "-q", str(up), str(work))
    git(work, "checkout", "-q", "-b", "old", "core_v0.1.0")
    write(work, "tests/unit_tests/test_basic.py", "def test_basic():  # old\n    pass\n")
    old = commit_all(work, "An older test file")
    git(work, "push", "-q", "origin", "old")
    git(work, "checkout", "-q", "-b", "patch", "core_v0.1.0")
    write(work, "megatron/core/constants.py", "ANSWER = 42\n")
    basic = work / "tests/unit_tests/test_basic.py"
    basic.write_text(basic.read_text() + "\n\ndef test_answer():\n    pass\n")
    commit_all(work, "Add the answer\n\nWith its test.\n")
    canonical = git(work, *FORMAT_PATCH)
    project = tmp_path / "proj"
    (project / "patches/old").mkdir(parents=True)
    (project / "patches/0001-answer.patch").write_text(canonical)
    code_only = canonical[: canonical.index("diff --git a/tests/")]
    code_only = code_only.replace(" 2 files changed", " 1 file changed")
    (project / "patches/old/0001-answer.patch").write_text(code_only)
    (project / "patches/manifest.toml").write_text(
        'canonical = "c0"\ndefault = "c0"\n\n[[patch]]\nid = "answer"\n'
        'file = "0001-answer.patch"\nfix = 1\n\n'
        f'[baselines.c0]\nsource = "git"\nref = "core_v0.1.0"\nversion = "0.1.0"\n'
        f'commit = "{world.commits["core_v0.1.0"]}"\n\n'
        f'[baselines.old]\nsource = "git"\nref = "old"\nversion = "0.0.9"\ncommit = "{old}"\n'
        '[baselines.old.variants]\nanswer = "old/0001-answer.patch"\n'
    )
    return project, up


def test_graft_tests_lands_a_test_section_three_way(world, tool, tmp_path):
    """An old tag whose test file differs near (not at) the lines a test section adds: the
    variant's code is kept, the donor's test change merged three-way onto that file."""
    project, up = graft_world(world, tmp_path)
    r = tool(project, "status", "--json", "--baseline", "old", "--mcore-repo", up)
    assert r.rc == 0, r.err
    assert "carries only code" in r.out
    r = tool(project, "graft-tests", "--baseline", "old", "--mcore-repo", up)
    assert r.rc == 0, r.err
    landed = "patches/old/0001-answer.patch (from c0): tests landed: tests/unit_tests/test_basic.py"
    assert landed in r.out, r.out
    assert tool(project, "vendor", "--baseline", "old", "--mcore-repo", up).rc == 0
    assert (project / "tests/unit_tests/test_basic.py").read_text() == (
        "def test_basic():  # old\n    pass\n\n\ndef test_answer():\n    pass\n"
    )
    r = tool(project, "status", "--json", "--baseline", "old", "--mcore-repo", up)
    assert "excluded" not in r.out, r.out


def test_graft_tests_never_writes_through_a_symlinked_variant(world, tool, tmp_path):
    """A variant file that is a symlink out of patches/: refused, the file it points to and
    the link left as they were."""
    project, up = graft_world(world, tmp_path)
    variant = project / "patches/old/0001-answer.patch"
    outside = tmp_path / "elsewhere.patch"
    os.replace(variant, outside)
    variant.symlink_to(outside)
    before = outside.read_bytes()
    r = tool(project, "graft-tests", "--baseline", "old", "--mcore-repo", up)
    assert r.rc == 2, r.text
    assert "patches/old/0001-answer.patch is a symlink" in r.err.strip().splitlines()[-1]
    assert outside.read_bytes() == before and variant.is_symlink()


def test_shallow_clone_of_a_release_branch_takes_its_tag(world, project, tool, tmp_path):
    """No pinned commit in a shallow clone's history, a version no baseline has: the release
    branch's name tells (core_r0.1.0 -> core_v0.1.5)."""
    c = release_branch(world, project, tmp_path)
    work = tmp_path / "upwork"
    write(work, "megatron/core/package_info.py", package_info(0, 1, 6, "rc0"))
    commit_all(work, "Bump to 0.1.6rc0")
    git(work, "push", "-q", "origin", "core_r0.1.0")
    co = tmp_path / "shallow"
    git(
        world.base, "clone", "-q", "--depth", "1", "-b", "core_r0.1.0", f"file://{c['up']}", str(co)
    )
    r = tool(project, "apply", co)
    assert r.rc == 0, r.err
    assert "baseline core_v0.1.5 (branch core_r0.1.0 is the release branch of core_v0.1.5)" in r.out


def test_a_skipped_test_section_reads_as_the_fix_kept():
    """git's `does not apply at FILE:LINE` for a test section reads like a failure: the line
    says the fix is in and why its upstream test is not, keeping where."""
    rel = "tests/unit_tests/test_optimizer.py"
    assert left_out_lines("chained-loss-scale", {rel: f"does not apply at {rel}:239"}) == [
        f"kept the fix, skipped its upstream test in {rel}: this baseline's copy of that file "
        "differs from the one the test was written against (at line 239)"
    ]
    sdist = "this tree has no upstream tests/ (a PyPI sdist)"
    assert left_out_lines("p", {rel: sdist}) == [
        f"kept the fix, skipped its upstream test in {rel}: {sdist}"
    ]
