"""docs/evidence.md is generated (`python -m mcore_fixes docs`) from the stored proofs and the
GPU records, and lists exactly the series' patches, in series order."""

from __future__ import annotations

import json
import re
import shutil
import sys

from toolworld import MAIN

from mcore_fixes import manifest
from mcore_fixes.maint import affected, evidence

M = manifest.load(MAIN / "patches" / "manifest.toml")


def rows(text: str) -> list[str]:
    """The patch ids of the page's CPU table (its first column), in order."""
    table = text.split("## CPU, every baseline", 1)[1].split("<details>", 1)[0]
    return re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M)


def test_the_evidence_page_is_generated_and_lists_exactly_the_series():
    text = (MAIN / "docs" / "evidence.md").read_text(encoding="utf-8")
    assert evidence.MARK in text  # written by `docs`, not by hand
    assert rows(text) == [p.id for p in M.patches]
    for p in M.patches:  # each row names the fix as users read it
        assert f"| `{p.id}` | {M.fix_label(p)} |" in text


def test_every_gpu_record_is_on_the_page():
    text = (MAIN / "docs" / "evidence.md").read_text(encoding="utf-8")
    for path in (MAIN / "docs" / "gpu").glob("*.md"):
        assert f"(gpu/{path.name})" in text, path.name


def test_docs_writes_the_page_from_the_last_prove(world, project, tool):
    """prove, then docs: each patch's row says where it failed before and passed after, and
    the counts behind it; a patch changed since is no longer shown proven; a GPU record of an
    earlier version of a patch says so."""
    args = ("--mcore-repo", world.upstream)
    (project / "README.md").write_text(f"{affected.BEGIN}\n{affected.END}\n")
    path = project / "patches" / "manifest.toml"
    head, sep, rest = path.read_text().partition("\n[baselines.")
    fixes = "".join(
        f'[fixes.{n}]\nname = "toy-{n}"\naffects = "a"\ndamage = "d"\naudit = "c"\n\n'
        for n in (1, 2, 3)
    )
    path.write_text(head + "\n" + fixes + sep.lstrip("\n") + rest)
    assert tool(project, "prove", "--python", sys.executable, *args).rc in (0, 1)
    gpu = project / "docs" / "gpu"
    gpu.mkdir(parents=True)
    (gpu / "proofs-0.1.0.json").write_text(
        json.dumps(
            {
                "fix-mean": {
                    "verdict": "proven",
                    "before": {"outcome": "failed", "summary": "1 failed, 2 warnings in 1.0s"},
                    "after": {"outcome": "passed", "summary": "1 passed in 1.0s"},
                    "sha256": "0" * 64,
                }
            }
        )
    )
    (gpu / "e2e.md").write_text("# End to end\n")
    r = tool(project, "docs", *args)
    assert "docs/evidence.md" in r.out, r.out + r.err
    text = (project / "docs" / "evidence.md").read_text()
    assert rows(text) == ["fix-mean", "join-sep", "weak-test"]
    assert "| `fix-mean` | toy-1 | 0.1.0, core_v0.1.1 | core_v0.2.0, core_v0.3.0 |" in text
    assert "| `fix-mean` | 0.1.0 | " in text  # its counts
    assert "weak-test" in text and "(passes-unpatched)" in text  # flagged, not proven
    assert "| 0.1.0 | `fix-mean` | proven | 1 failed | 1 passed | an earlier version " in text
    assert "- [gpu/e2e.md](gpu/e2e.md): End to end" in text
    assert tool(project, "docs", "--check", *args).rc == 0
    # Without the checkout (nor its trees) the git baselines cannot be shown: the page stays.
    for tree in (project / "build" / "trees").glob("core_v*"):
        shutil.rmtree(tree)
    r = tool(project, "docs")
    assert r.rc == 0 and "docs/evidence.md: not written: core_v0.1.1" in r.out, r.out
    assert (project / "docs" / "evidence.md").read_text() == text
