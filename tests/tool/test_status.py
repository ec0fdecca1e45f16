"""`status`: the patch x baseline matrix as a table, JSON and Markdown."""

from __future__ import annotations

import json

STATES = {
    ("0.1.0", "fix-mean"): "applies",
    ("0.1.0", "join-sep"): "applies",
    ("0.1.0", "weak-test"): "applies",
    ("core_v0.1.1", "fix-mean"): "applies",
    ("core_v0.1.1", "join-sep"): "applies",
    ("core_v0.1.1", "weak-test"): "absent",
    ("core_v0.2.0", "fix-mean"): "applied-upstream",
    ("core_v0.2.0", "join-sep"): "applies",
    ("core_v0.2.0", "weak-test"): "applies",
    ("core_v0.3.0", "fix-mean"): "applied-upstream",
    ("core_v0.3.0", "join-sep"): "conflict",
    ("core_v0.3.0", "weak-test"): "applies",
}


def test_status_json_shape_and_states(world, project, tool):
    r = tool(project, "status", "--json", "--mcore-repo", world.upstream)
    assert r.rc == 0, r.err
    data = json.loads(r.out)
    assert set(data) == {"baselines", "patches", "cells", "variants"}
    assert [b["name"] for b in data["baselines"]] == [
        "0.1.0",
        "core_v0.1.1",
        "core_v0.2.0",
        "core_v0.3.0",
    ]
    pypi = data["baselines"][0]
    assert pypi == {"name": "0.1.0", "source": "pypi", "version": "0.1.0", "pin": world.sdist_sha}
    assert data["baselines"][2]["pin"] == world.commits["core_v0.2.0"]
    assert data["patches"] == [
        {"id": "fix-mean", "fix": 1, "file": "0001-fix-mean.patch", "requires": []},
        {"id": "join-sep", "fix": 2, "file": "0002-join-sep.patch", "requires": ["fix-mean"]},
        {"id": "weak-test", "fix": 3, "file": "0003-weak-test.patch", "requires": []},
    ]
    cells = {(c["baseline"], c["patch"]): c for c in data["cells"]}
    assert {k: c["state"] for k, c in cells.items()} == STATES
    for c in data["cells"]:
        assert {"patch", "baseline", "state"} <= set(c)
    assert cells[("core_v0.1.1", "weak-test")]["detail"] == "constants.py does not exist in 0.1.1"
    assert "file" not in cells[("core_v0.1.1", "weak-test")]
    assert cells[("core_v0.2.0", "fix-mean")]["file"] == "0001-fix-mean.patch"
    assert "already in" in cells[("core_v0.2.0", "fix-mean")]["detail"]
    assert "megatron/core/util.py" in cells[("core_v0.3.0", "join-sep")]["detail"]


def test_a_required_patch_absent_on_a_baseline_is_no_prerequisite_there(world, project, tool):
    # join-sep requires fix-mean; where fix-mean's target code does not exist (absent), the
    # patch that requires it stands without it, as where upstream fixed it its own way
    manifest = project / "patches/manifest.toml"
    absent = 'absent = { weak-test = "constants.py does not exist in 0.1.1" }'
    assert absent in manifest.read_text()
    manifest.write_text(
        manifest.read_text().replace(
            absent,
            'absent = { weak-test = "constants.py does not exist in 0.1.1", '
            'fix-mean = "mean() does not exist in 0.1.1" }',
        )
    )
    r = tool(
        project, "status", "--json", "--mcore-repo", world.upstream, "--baseline", "core_v0.1.1"
    )
    assert r.rc == 0, r.err
    states = {c["patch"]: c["state"] for c in json.loads(r.out)["cells"]}
    assert states == {"fix-mean": "absent", "join-sep": "applies", "weak-test": "absent"}


def test_status_table(world, project, tool):
    r = tool(project, "status", "--mcore-repo", world.upstream)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].split() == [
        "baseline",
        "fix-mean",
        "(fix",
        "1)",
        "join-sep",
        "(fix",
        "2)",
        "weak-test",
        "(fix",
        "3)",
    ]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:6]}
    assert rows == {
        "0.1.0": ["applies", "applies", "applies"],
        "core_v0.1.1": ["applies", "applies", "absent"],
        "core_v0.2.0": ["applied-upstream", "applies", "applies"],
        "core_v0.3.0": ["applied-upstream", "conflict", "applies"],
    }
    assert "core_v0.3.0 / join-sep: conflict: does not apply at megatron/core/util.py" in r.out
    assert "core_v0.1.1 / weak-test: absent: constants.py does not exist in 0.1.1" in r.out


def test_status_markdown(world, project, tool):
    r = tool(
        project, "status", "--markdown", "--mcore-repo", world.upstream, "--baseline", "core_v0.3.0"
    )
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    # One short column per patch (its file's number), a code per cell, then what they mean.
    assert lines[0] == "| baseline    | 1 | 2 | 3 |"
    assert lines[1] == "|-------------|---|---|---|"
    assert lines[2] == "| core_v0.3.0 | u | C | a |"
    assert lines[3] == ""
    assert "| 2      | `join-sep`  | fix 2 |" in lines
    assert "Cells: `u` applied-upstream; `C` conflict; `a` applies." in lines
    assert any(ln.startswith("- `join-sep` conflict on core_v0.3.0: ") for ln in lines)


def test_status_markdown_fits_100_columns(world, project, tool):
    r = tool(project, "status", "--markdown", "--mcore-repo", world.upstream)
    assert r.rc == 0, r.err
    assert max(len(ln) for ln in r.out.splitlines()) <= 100
    grid = r.out.split("\n\n")[0].splitlines()
    assert [ln.split("|")[1].strip() for ln in grid[2:]] == [
        "0.1.0",
        "core_v0.1.1",
        "core_v0.2.0",
        "core_v0.3.0",
    ]
    assert grid[3].split("|")[2:-1] == [" a ", " a ", " - "]  # weak-test absent in 0.1.1


def test_status_git_baselines_skipped_without_checkout(world, tool, tmp_path, monkeypatch):
    project = world.project(tmp_path / "proj", prebuilt=False)
    monkeypatch.delenv("MCORE_REPO", raising=False)
    r = tool(project, "status", "--json")
    assert r.rc == 0, r.err
    cells = json.loads(r.out)["cells"]
    for c in cells:
        if c["baseline"] == "0.1.0":
            assert c["state"] == "applies"
        else:
            assert c["state"] == "skipped"
            assert "--mcore-repo" in c["detail"] and "MCORE_REPO" in c["detail"]
    r = tool(project, "status")
    assert r.rc == 0
    # One reason for all the skipped cells: said once, not nine times.
    assert r.out.count("--mcore-repo") == 1
    assert "skipped: no Megatron-LM checkout" in r.out


def test_status_materialized_git_tree_needs_no_checkout(project, tool):
    # build/trees/core_v0.3.0 exists at the pinned commit: no --mcore-repo needed.
    r = tool(project, "status", "--json", "--baseline", "core_v0.3.0")
    assert r.rc == 0, r.err
    states = [c["state"] for c in json.loads(r.out)["cells"]]
    assert states == ["applied-upstream", "conflict", "applies"]


def test_status_mcore_repo_from_environment(world, project, tool, monkeypatch):
    monkeypatch.setenv("MCORE_REPO", str(world.upstream))
    r = tool(project, "status", "--json", "--baseline", "core_v0.2.0")
    assert r.rc == 0, r.err
    states = [c["state"] for c in json.loads(r.out)["cells"]]
    assert states == ["applied-upstream", "applies", "applies"]


def test_status_pin_not_in_checkout_is_skipped_with_reason(world, tool, tmp_path):
    # A Megatron-LM checkout that lacks the pinned commits (an old clone).
    project = world.project(tmp_path / "proj", prebuilt=False)
    old = tmp_path / "old"
    world.clone(old, "core_v0.1.0")
    from toolworld import git

    git(old, "tag", "-d", "core_v0.1.1", "core_v0.2.0", "core_v0.3.0")
    git(old, "branch", "-D", "main")
    git(old, "remote", "remove", "origin")
    git(old, "reflog", "expire", "--expire=now", "--all")
    git(old, "gc", "-q", "--prune=now")
    r = tool(project, "status", "--json", "--mcore-repo", old, "--baseline", "core_v0.3.0")
    assert r.rc == 0, r.err
    cells = json.loads(r.out)["cells"]
    assert {c["state"] for c in cells} == {"skipped"}
    assert "is not in" in cells[0]["detail"] and "git fetch" in cells[0]["detail"]


def test_status_missing_patch_file(project, tool):
    (project / "patches" / "0003-weak-test.patch").unlink()
    r = tool(project, "status", "--json", "--baseline", "0.1.0")
    assert r.rc == 0, r.err
    states = {c["patch"]: c["state"] for c in json.loads(r.out)["cells"]}
    assert states == {"fix-mean": "applies", "join-sep": "applies", "weak-test": "missing"}


def test_status_bad_mcore_repo(project, tool, tmp_path):
    r = tool(project, "status", "--mcore-repo", tmp_path / "nowhere")
    assert r.rc == 2
    assert "does not exist" in r.err and len(r.err.strip().splitlines()) == 1
    r = tool(project, "status", "--mcore-repo", tmp_path)
    assert r.rc == 2
    assert "is not a git repository" in r.err


def test_status_via_python_m(world, project):
    from toolworld import run_module

    r = run_module(project, "status", "--json", "--baseline", "0.1.0")
    assert r.rc == 0, r.err
    assert '"state": "applies"' in r.out
