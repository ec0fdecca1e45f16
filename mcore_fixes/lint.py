"""`lint-patches`: the lines a patch adds must be what upstream's formatters would write.

Only the patch's own lines are judged (a formatter diff line that removes a line the patch
added), so upstream code formatted by another black release does not count against us.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

# Megatron-LM main's settings (pyproject.toml [tool.black], .pre-commit-config.yaml); the
# config file is replaced so that an older baseline's `required-version` does not apply.
BLACK = ["black", "--diff", "-q", "-l", "100", "--skip-string-normalization",
         "--skip-magic-trailing-comma"]  # fmt: skip
ISORT = ["isort", "--diff", "--profile", "black", "-l", "100", "-p", "megatron"]


def added_lines(patch_text: str) -> dict[str, set[str]]:
    """Per file, the lines a patch adds (without the leading '+')."""
    added: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            path = line[4:]
            current = added.setdefault(path[2:], set()) if path.startswith("b/") else None
        elif line.startswith("diff --git "):
            current = None
        elif current is not None and line.startswith("+"):
            current.add(line[1:])
    return added


def _offending(diff: str, ours: set[str]) -> list[str]:
    # Blank lines are everybody's: a blank line black drops may be upstream's.
    return [
        ln[1:] for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")
        if ln[1:].strip() and ln[1:] in ours
    ]  # fmt: skip


def lint(tree: Path, patch_texts: list[str]) -> list[str]:
    """Problems in the lines the patches add to Python files of `tree` (empty: clean)."""
    ours: dict[str, set[str]] = {}
    for text in patch_texts:
        for path, lines in added_lines(text).items():
            ours.setdefault(path, set()).update(lines)
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "black.toml"
        config.write_text("[tool.black]\n")
        for path, lines in sorted(ours.items()):
            if not path.endswith(".py") or not (tree / path).exists():
                continue
            tools = [("black", [*BLACK, "--config", str(config), path])]
            if path.startswith("megatron/core/"):
                tools.append(("isort", [*ISORT, path]))
            for name, cmd in tools:
                proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
                if proc.returncode not in (0, 1):
                    problems.append(f"{path}: {name} failed: {proc.stderr.strip()}")
                for line in _offending(proc.stdout, lines):
                    problems.append(f"{path}: {name} would rewrite: {line.strip()}")
    return problems
