"""The docs speak to users: every relative link resolves, and no internal vocabulary (work-item
numbers, remote-run tool calls, files outside the repository) appears where users read."""

from __future__ import annotations

import re

from toolworld import MAIN

DOCS = [MAIN / "README.md", MAIN / "CHANGELOG.md", *sorted((MAIN / "docs").rglob("*.md"))]
# What users, maintainers and upstream read: the docs, our scripts' comments, the tool's text.
READ = [
    *DOCS,
    *sorted((MAIN / "docs").rglob("*.txt")),
    *sorted((MAIN / "bench").glob("*.sh")),
    *sorted((MAIN / "bench").glob("*.py")),
    *sorted((MAIN / "mcore_fixes").glob("*.py")),
    *sorted((MAIN / "mcore_fixes" / "maint").glob("*.py")),
    MAIN / "patches" / "manifest.toml",
    MAIN / "noxfile.py",
    MAIN / "setup.py",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A file of this repository named in prose (`bench/e2e_gpu.sh`, `docs/gpu/e2e-{a,b}.log`);
# tests/unit_tests/ is upstream's (materialized, never committed here).
NAMED = re.compile(r"(?<![\w/.])(?:bench|docs|tests|patches|mcore_fixes)/[\w./{},-]*\.[a-z]{1,5}\b")
INTERNAL = re.compile(
    r"\bsessions? \d+|\bthis stop\b|\bissues? \d+|\(issues? \d|\brun\(command=|carry=\["
    r"|DESIGN\.md|\.\./shared|device call|\bworkplace\b|\bhelper (?:session|call)",
    re.IGNORECASE,
)


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor of the same page
            if not (doc.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{doc.relative_to(MAIN)}: {target}")
    assert broken == []


def expand(name: str) -> list[str]:
    """Shell-style braces: `a-{x,y}.log` -> a-x.log, a-y.log."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [n for alt in m.group(1).split(",") for n in expand(name.replace(m.group(0), alt, 1))]


def test_every_file_the_docs_name_exists():
    missing = [
        f"{doc.relative_to(MAIN)}: {name}"
        for doc in DOCS
        for named in NAMED.findall(doc.read_text(encoding="utf-8"))
        if not named.startswith("tests/unit_tests/")
        for name in expand(named)
        if not (MAIN / name).exists()
    ]
    assert missing == []


def cells(row: str) -> int:
    """Cells of a markdown table row (a `|` inside backticks or escaped is text)."""
    return len(re.sub(r"`[^`]*`", "", row).replace("\\|", "").split("|")) - 2


def test_every_table_row_has_its_header_columns():
    uneven = []
    for doc in DOCS:
        rows: list[tuple[int, str]] = []
        for n, line in enumerate([*doc.read_text(encoding="utf-8").splitlines(), ""], 1):
            if line.startswith("|"):
                rows.append((n, line))
                continue
            uneven += [
                f"{doc.relative_to(MAIN)}:{k}: {cells(row)} cells, header {cells(rows[0][1])}"
                for k, row in rows
                if cells(row) != cells(rows[0][1])
            ]
            rows = []
    assert uneven == []


def test_no_internal_vocabulary_where_users_read():
    found = [
        f"{path.relative_to(MAIN)}:{n}: {m.group(0)!r}"
        for path in READ
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for m in INTERNAL.finditer(line)
    ]
    assert found == []


def test_readme_names_the_test_command_and_the_maintainers_guide():
    readme = (MAIN / "README.md").read_text(encoding="utf-8")
    assert "\n    python3 -m pip install nox uv && nox\n" in readme  # what .ci/run runs
    assert "](docs/maintainers.md)" in readme


def test_the_status_matrix_in_the_docs_fits_100_columns():
    blocks = 0
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"<!-- status:begin -->\n(.*?)<!-- status:end -->", text, re.S):
            blocks += 1
            wide = [ln for ln in block.splitlines() if len(ln) > 100]
            assert wide == [], f"{doc.relative_to(MAIN)}: {wide[0][:60]}..."
    assert blocks == 1
