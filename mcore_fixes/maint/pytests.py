"""The pytest command line of the tool's test runs (prove's proofs, test, lint's collection)."""

from __future__ import annotations


def pytest_command(python: str, files: list[str]) -> list[str]:
    # --noconftest: upstream's tests/unit_tests/conftest.py needs Python 3.12 and its data
    # helpers (it downloads test data unless /opt/data exists); our proofs need neither.
    # -o addopts=: the baseline's pyproject.toml adds -x (0.16.1) and -s; we want every result.
    return [
        python,
        "-m",
        "pytest",
        "--noconftest",
        "-o",
        "addopts=",
        "-p",
        "no:cacheprovider",
        "-q",
        *files,
    ]
