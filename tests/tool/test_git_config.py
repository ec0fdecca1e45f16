"""The user's git config must not leak into the tool's own trees (build/trees/*)."""

from __future__ import annotations

import json
import os
import sys

from toolworld import TEST_FILES, tree_snapshot


def test_hostile_user_git_config(world, tool, tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("pre-commit", "commit-msg", "applypatch-msg", "pre-applypatch", "post-rewrite"):
        (hooks / name).write_text("#!/bin/sh\necho hook refused >&2\nexit 1\n")
        (hooks / name).chmod(0o755)
    cfg = tmp_path / "gitconfig"
    cfg.write_text(
        open(os.environ["GIT_CONFIG_GLOBAL"]).read()
        + "[commit]\n\tgpgSign = true\n[gpg]\n\tprogram = false\n"
        + "[core]\n\tautocrlf = true\n\thooksPath = "
        + str(hooks)
        + "\n"
        + "[diff]\n\tnoprefix = true\n\talgorithm = histogram\n\tcontext = 5\n"
        + '[format]\n\tsignOff = true\n\theaders = "X-Leak: yes\\n"\n'
        + "[apply]\n\twhitespace = error\n"
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(cfg))
    project = world.project(tmp_path / "proj", prebuilt=False)
    before = tree_snapshot(project / "patches")

    r = tool(project, "status", "--json", "--mcore-repo", world.upstream)
    assert r.rc == 0, r.err
    states = [c["state"] for c in json.loads(r.out)["cells"]]
    assert states.count("applies") == 8 and states.count("conflict") == 1
    r = tool(project, "vendor")
    assert r.rc == 0, r.err
    assert b"\r\n" not in (project / "megatron/core/calc.py").read_bytes()
    r = tool(project, "export")
    assert r.rc == 0 and "updated" not in r.out, r.out + r.err
    test = project / TEST_FILES["fix-mean"]
    test.write_text(test.read_text() + "# more\n")
    r = tool(project, "export")
    assert r.rc == 0, r.err
    text = (project / "patches/0001-fix-mean.patch").read_text()
    assert "X-Leak" not in text and "diff --git a/" in text
    assert text.count("Signed-off-by:") == 1
    r = tool(
        project, "prove", "--python", sys.executable, "--baseline", "0.1.0", "--patch", "fix-mean"
    )
    assert r.rc == 0, r.out + r.err
    after = tree_snapshot(project / "patches")
    assert {k for k in before if before[k] != after[k]} == {"0001-fix-mean.patch"}
