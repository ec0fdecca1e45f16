"""Our CPU proofs (manifest `proof`), code-only application on trees without upstream tests,
and fixes made of several patches."""

from __future__ import annotations

import json
import sys

from toolworld import FORMAT_PATCH, PATCH_FILES, commit_all, git, write

QUESTION_PROOF = """from megatron.core import constants


def test_question_is_defined():
    assert constants.QUESTION == "six by nine"
"""


def add_question_patch(world, project, tmp_path) -> None:
    """A second patch of fix 3 that also edits upstream's own tests/unit_tests/test_basic.py."""
    scratch = tmp_path / "scratch"
    git(world.base, "clone", "-q", str(world.upstream), str(scratch))
    git(scratch, "checkout", "-q", "core_v0.1.0")
    for name in PATCH_FILES.values():
        git(scratch, "am", "-q", str(project / "patches" / name))
    write(scratch, "megatron/core/constants.py", 'ANSWER = 42\nQUESTION = "six by nine"\n')
    basic = scratch / "tests/unit_tests/test_basic.py"
    basic.write_text(basic.read_text() + "\n\ndef test_question():\n    pass\n")
    commit_all(scratch, "Add the question\n\nUpstream's test file gains a case.\n")
    (project / "patches/0004-question.patch").write_text(git(scratch, *FORMAT_PATCH))
    write(project, "tests/proofs/test_question.py", QUESTION_PROOF)
    with (project / "patches/manifest.toml").open("a") as f:
        f.write(
            '\n[[patch]]\nid = "question"\nfile = "0004-question.patch"\nfix = 3\n'
            'requires = ["weak-test"]\nproof = "tests/proofs/test_question.py"\n'
        )


def test_patch_editing_upstream_tests_applies_code_only_without_them(
    world, project, tool, tmp_path
):
    add_question_patch(world, project, tmp_path)
    args = ("--mcore-repo", world.upstream, "--baseline", "0.1.0", "--baseline", "core_v0.2.0")
    r = tool(project, "status", "--json", *args)
    assert r.rc == 0, r.err
    cells = {(c["baseline"], c["patch"]): c for c in json.loads(r.out)["cells"]}
    # The sdist has no tests/: the patch's code applies, its tests are left out (and said so).
    pypi = cells[("0.1.0", "question")]
    assert pypi["state"] == "applies"
    assert list(pypi["excluded"]) == ["tests/unit_tests/test_basic.py"]
    assert "PyPI sdist" in pypi["excluded"]["tests/unit_tests/test_basic.py"]
    # A git baseline has upstream's tests: the whole patch applies there.
    assert cells[("core_v0.2.0", "question")]["state"] == "applies"
    assert "excluded" not in cells[("core_v0.2.0", "question")]
    # A patch that applies whole on the sdist keeps its new test files there.
    assert "excluded" not in cells[("0.1.0", "weak-test")]

    # Two patches of one fix: both in the matrix, both recorded in the vendored tree.
    md = tool(project, "status", "--markdown", "--baseline", "0.1.0").out
    assert md.splitlines()[0] == "| baseline | 1 | 2 | 3 | 4 |"
    assert "| 3      | `weak-test` | fix 3 |" in md.splitlines()
    assert "| 4      | `question`  | fix 3 |" in md.splitlines()
    assert tool(project, "vendor").rc == 0
    info = json.loads((project / "megatron/core/_mcore_fixes.json").read_text())
    assert [(a["id"], a["fix"]) for a in info["applied"]][-2:] == [
        ("weak-test", 3),
        ("question", 3),
    ]
    assert not (project / "tests/unit_tests/test_basic.py").exists()
    # Nothing edited: export leaves the patch (with its test sections) as it is.
    before = (project / "patches/0004-question.patch").read_text()
    r = tool(project, "export")
    assert r.rc == 0, r.err
    assert (project / "patches/0004-question.patch").read_text() == before

    # prove runs our proof, not the patch's tests: fail before, pass after, on both trees.
    r = tool(project, "prove", "--python", sys.executable, *args, "--patch", "question")
    assert r.rc == 0, r.out + r.err
    for baseline in ("0.1.0", "core_v0.2.0"):
        proof = json.loads((project / f"build/proofs/{baseline}.json").read_text())["question"]
        assert proof["verdict"] == "proven", proof
        assert proof["tests"] == ["tests/proofs/test_question.py"]
        assert proof["before"] == {"outcome": "failed", "summary": "1 failed"}


def test_prove_one_pytest_process_per_tree_state(project, tool):
    r = tool(project, "prove", "--python", sys.executable, "--baseline", "0.1.0")
    assert r.rc == 1  # weak-test's own test cannot fail
    store = json.loads((project / "build/proofs/0.1.0.json").read_text())
    assert store["fix-mean"]["verdict"] == store["join-sep"]["verdict"] == "proven"
    # pristine (fix-mean before), fix-mean (its after, join-sep's before), join-sep (after);
    # weak-test has no proof: its carried test runs twice, the old way.
    assert "5 pytest processes (3 for our proofs: 4 proof runs" in r.err


def test_proof_changes_drop_the_stored_proof(project, tool):
    args = ("--python", sys.executable, "--baseline", "0.1.0", "--patch", "fix-mean")
    assert tool(project, "prove", *args).rc == 0
    status = json.loads(tool(project, "status", "--json", "--baseline", "0.1.0").out)["cells"]
    assert status[0]["proof"]["verdict"] == "proven"
    proof = project / "tests/proofs/test_fix_mean.py"
    proof.write_text(proof.read_text() + "\n# edited\n")
    status = json.loads(tool(project, "status", "--json", "--baseline", "0.1.0").out)["cells"]
    assert "proof" not in status[0]


def test_proof_that_does_not_import_unpatched_is_flagged(project, tool):
    proof = project / "tests/proofs/test_fix_mean.py"
    proof.write_text("from megatron.core.calc import median  # only after the patch\n")
    patch = project / "patches" / PATCH_FILES["fix-mean"]
    assert (
        tool(
            project,
            "prove",
            "--python",
            sys.executable,
            "--baseline",
            "0.1.0",
            "--patch",
            "fix-mean",
        ).rc
        == 1
    )
    store = json.loads((project / "build/proofs/0.1.0.json").read_text())
    assert store["fix-mean"]["verdict"] in ("no-import-unpatched", "fails-patched")
    assert patch.exists()


def test_missing_proof_file_and_bad_proof_path(project, tool):
    (project / "tests/proofs/test_fix_mean.py").unlink()
    r = tool(
        project, "prove", "--python", sys.executable, "--baseline", "0.1.0", "--patch", "fix-mean"
    )
    assert r.rc == 1 and "PROOF FILE MISSING" in r.out
    manifest = project / "patches/manifest.toml"
    manifest.write_text(
        manifest.read_text().replace('"tests/proofs/test_fix_mean.py"', '"../escape.py"')
    )
    r = tool(project, "status", "--baseline", "0.1.0")
    assert r.rc == 2 and "must be a relative path tests/" in r.err


def test_prove_changed_keeps_proofs_that_still_hold(project, tool):
    args = ("prove", "--python", sys.executable, "--baseline", "0.1.0", "--patch", "join-sep")
    assert tool(project, *args).rc == 0
    r = tool(project, *args, "--changed")
    assert r.rc == 0 and "0 pytest processes" in r.err and "applies, proven" in r.out
    proof = project / "tests/proofs/test_join_sep.py"
    proof.write_text(proof.read_text() + "\n# edited\n")
    r = tool(project, *args, "--changed")
    assert r.rc == 0 and "2 pytest processes" in r.err
