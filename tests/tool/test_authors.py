"""One author for the fork's own patches: the tool's identity, on every baseline's file.

Upstream's commits that the series carries (manifest `origin`) keep their original authors.
"""

from __future__ import annotations

import re

from toolworld import MAIN

from mcore_fixes import git
from mcore_fixes.manifest import load

IDENTITY = f"{git.TOOL_IDENTITY['GIT_AUTHOR_NAME']} <{git.TOOL_IDENTITY['GIT_AUTHOR_EMAIL']}>"


def _author(path) -> str:
    m = re.search(r"^From: (.*)$", path.read_text(encoding="utf-8"), re.MULTILINE)
    assert m, f"{path}: no From: line"
    return m.group(1)


def test_our_patches_have_one_author_and_carried_commits_keep_theirs():
    manifest = load(MAIN / "patches" / "manifest.toml")
    ours, carried = {}, {}
    for patch in manifest.patches:
        files = {manifest.root / patch.file}
        files |= {
            manifest.root / b.variants[patch.id]
            for b in manifest.baselines.values()
            if patch.id in b.variants
        }
        for path in files:
            (carried if patch.origin else ours)[path.relative_to(MAIN)] = _author(path)
    assert {path: who for path, who in ours.items() if who != IDENTITY} == {}
    assert IDENTITY not in carried.values(), carried
