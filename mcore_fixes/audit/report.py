"""Verdicts (one per check) and the report of one checkpoint."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, DAMAGED, CANNOT_TELL = "ok", "damaged", "cannot tell"
SHOWN = 4  # params named in a text line; --json lists all


@dataclass
class Verdict:
    check: str
    verdict: str
    summary: str
    evidence: dict = field(default_factory=dict)
    fork: str = ""  # what loading it on the fork does
    stock: str = ""  # what loading it on stock MCore does
    details: list[str] = field(default_factory=list)  # evidence lines under the first one
    todo: str = ""  # what to do (damaged, cannot tell)

    def line(self) -> str:
        return f"{self.check}: {self.verdict}: {self.summary}"

    def lines(self) -> Iterator[str]:
        """The verdict's line, then its evidence, what loading it does and what to do,
        indented."""
        yield self.line()
        for detail in self.details[:SHOWN]:
            yield f"    {detail}"
        if len(self.details) > SHOWN:
            yield f"    and {len(self.details) - SHOWN} more (--json lists all)"
        loads = [f"the fork {self.fork}" if self.fork else "", f"stock {self.stock}"]
        loads = [x for x in loads if x != "stock "]
        if self.verdict != OK and any(loads):
            yield f"    on load: {'; '.join(x for x in loads if x)}"
        if self.todo:
            yield f"    what to do: {self.todo}"

    def as_json(self) -> dict:
        data = {"check": self.check, "verdict": self.verdict, "summary": self.summary}
        data["evidence"] = self.evidence
        data["details"] = self.details
        data["on_load"] = {"fork": self.fork, "stock": self.stock}
        data["what_to_do"] = self.todo
        return data


def _names(items: list[str], shown: int = SHOWN) -> str:
    head = ", ".join(items[:shown])
    return head + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _where(where: str, path: tuple) -> str:
    """A readable place: the item or file, then the keys down to the value."""
    keys = ".".join(map(_key, path))
    if where in ("common_state", "common.pt"):
        return keys or "(top level)"
    if where.endswith(".pt"):
        return f"{where}: {keys}" if keys else where
    return f"{where}.{keys}" if keys else where


def _key(key: Any, depth: int = 0) -> str:
    """A key of a saved dict, for a message: as Python prints it, where it is a string, a
    number or a short tuple of them; else its type."""
    if isinstance(key, str):
        return repr(str(key)) if depth else key
    if key is None or isinstance(key, float) or (isinstance(key, int) and abs(key) < 2**64):
        return str(key)
    if isinstance(key, tuple) and depth < 4 and len(key) <= 16:
        return f"({', '.join(_key(k, depth + 1) for k in key)}{',' * (len(key) == 1)})"
    return f"<{type(key).__name__}>"


def plain(value: Any, depth: int = 0) -> Any:
    """`value` as JSON carries it: NaN and infinities as the strings "NaN", "Infinity" and
    "-Infinity", what JSON has no type for by its type's name."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, float):
        return value
    if isinstance(value, int) and abs(value) < 2**63:
        return value
    if isinstance(value, dict) and depth < 8:
        return {_key(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and depth < 8:
        return [plain(v, depth + 1) for v in value]
    return f"<{type(value).__name__}>"


@dataclass
class Report:
    path: Path
    kind: str
    iteration: Any
    note: str
    verdicts: list[Verdict]

    @property
    def exit_code(self) -> int:
        return 1 if any(v.verdict == DAMAGED for v in self.verdicts) else 0

    def text(self) -> Iterator[str]:
        it = f", iteration {self.iteration}" if self.iteration is not None else ""
        note = f" ({self.note})" if self.note else ""
        yield f"{self.path}: {self.kind} checkpoint{it}{note}"
        for v in self.verdicts:
            yield from v.lines()

    def as_json(self) -> dict:
        """The report as JSON carries it (`plain`)."""
        return plain(
            {
                "checkpoint": str(self.path),
                "format": self.kind,
                "iteration": self.iteration,
                "note": self.note,
                "checks": [v.as_json() for v in self.verdicts],
                "damaged": self.exit_code == 1,
            }
        )
