"""Where saved main params are among a checkpoint's model weights (numpy, windowed).

A DistributedOptimizer keeps an fp32 main param per param: for a 16-bit param, its value cast to
16 bits is the model weight (the step copies it there); for an fp32 param, it is the weight.
So every stretch of saved main params can be traced to the model weight it belongs to, bit for
bit: `Index.locate` scans a saved tensor, finds where a weight's values begin (fingerprints of
K elements, one per STRIDE elements of every weight), follows the match element by element to
its exact extent, and goes on after it. Memory: a window of each tensor at a time, plus the
fingerprint table: 20 bytes per STRIDE (64) elements of the model, at most ENTRIES of them (a
model of more than 268M params gets them further apart, small weights keeping 16 each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .ckptread import to_float32

WINDOW = 1 << 20  # elements compared at once
K = 16  # elements per fingerprint
STRIDE = 64  # one fingerprint per STRIDE elements of each model weight, at most
ENTRIES = 1 << 22  # fingerprints kept (80 MiB); larger models take them further apart
PROBE = 256  # elements first searched for a match after the previous one
SIXTEEN = ("bfloat16", "float16")
CHECKED = ("float32", *SIXTEEN)  # model weight dtypes the audit compares with
_MULT = (np.random.default_rng(20261201).integers(1, 2**62, K, dtype=np.uint64) | 1).astype(
    np.uint64
)


def codes(values: np.ndarray, dtype: str, target: str) -> np.ndarray:
    """Bit patterns of `values` (read as `dtype`) cast to `target` as MCore casts: round to
    nearest even, like torch's (and CUDA's) float -> bfloat16 / float16 conversion."""
    if dtype == target:
        return values.view(np.uint32 if dtype == "float32" else np.uint16)
    x = to_float32(values, dtype)
    if target == "float32":
        return x.view(np.uint32)
    if target == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as torch casts
            return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    rounded[np.isnan(x)] = 0x7FC0
    return rounded


def fingerprints(c: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Fingerprints of the K-element blocks that start every `stride` elements of codes `c`,
    and which of those blocks are constant (all elements equal: they tell nothing apart)."""
    n = c.size - K + 1
    if n <= 0:
        return np.empty(0, np.uint64), np.empty(0, bool)
    c = c.astype(np.uint64)
    first = c[0:n:stride]
    h = np.zeros(first.size, np.uint64)
    const = np.ones(first.size, bool)
    for j in range(K):
        block = c[j : j + n : stride]  # element j of every block
        h += block * _MULT[j]  # wraps modulo 2**64
        const &= block == first
    return h, const


@dataclass
class Run:
    """Region positions [start, end) hold the main param of `unit` from `unit_start` on."""

    unit: str
    start: int
    end: int
    unit_start: int


class Index:
    """Fingerprints of every model weight (`units`: name -> unit with dtype and source)."""

    def __init__(self, units: dict[str, Any]):
        self.units = units
        self.names = list(units)
        self.informative: set[str] = set()  # weights not made of one repeated value
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        total = sum(u.numel for u in units.values() if u.dtype in CHECKED)
        widest = max(STRIDE, 1 << max(0, (total // ENTRIES).bit_length()))
        for uid, name in enumerate(self.names):
            unit = units[name]
            if unit.dtype not in CHECKED:
                continue
            stride = min(widest, max(STRIDE, 1 << max(0, (unit.numel // 16).bit_length() - 1)))
            for start in range(0, unit.numel, WINDOW):  # WINDOW is a multiple of any stride
                window = unit.source.read(start, min(unit.numel, start + WINDOW + K - 1))
                h, const = fingerprints(codes(window, unit.dtype, unit.dtype), stride)
                keep = ~const
                if keep.any():
                    self.informative.add(name)
                offsets = np.flatnonzero(keep).astype(np.int64) * stride + start
                ids = np.full(offsets.size, uid, np.int32)
                parts.setdefault(unit.dtype, []).append((h[keep], ids, offsets))
        self.tables = {}
        for dtype, chunks in parts.items():
            h = np.concatenate([p[0] for p in chunks])
            order = np.argsort(h, kind="stable")
            ids = np.concatenate([p[1] for p in chunks])[order]
            offsets = np.concatenate([p[2] for p in chunks])[order]
            self.tables[dtype] = (h[order], ids, offsets)

    def _first_hit(self, window: np.ndarray, dtype: str) -> tuple[int, list[tuple[int, int]]]:
        """The first position of `window` (saved values of `dtype`) where a model weight's
        fingerprint occurs, and the (unit id, unit offset) candidates there; (-1, [])."""
        best, found = -1, []
        for target, (table, ids, offsets) in self.tables.items():
            h, const = fingerprints(codes(window, dtype, target), 1)
            pos = np.searchsorted(table, h)
            inside = pos < table.size
            hit = np.zeros(h.size, bool)
            hit[inside] = table[pos[inside]] == h[inside]
            hit &= ~const
            where = np.flatnonzero(hit)
            if where.size == 0 or (best >= 0 and where[0] > best):
                continue
            p = int(where[0])
            lo, hi = int(pos[p]), int(np.searchsorted(table, h[p], side="right"))
            cands = [(int(ids[i]), int(offsets[i])) for i in range(lo, hi)]
            found = cands if p < best or best < 0 else found + cands
            best = p
        return best, found

    def _extent(
        self, source: Any, dtype: str, at: int, unit: Any, unit_at: int, low: int
    ) -> tuple[int, int]:
        """How far the match of source[at] with unit[unit_at] reaches: back (not below `low`)
        and forward, element by element."""
        back = min(at - low, unit_at)
        if back:
            mine = codes(source.read(at - back, at), dtype, unit.dtype)
            theirs = unit.source.read(unit_at - back, unit_at).view(mine.dtype)
            differ = np.flatnonzero(mine != theirs)
            back = back - 1 - int(differ[-1]) if differ.size else back
        forward = 0
        limit = min(source.numel - at, unit.numel - unit_at)
        while forward < limit:
            n = min(WINDOW, limit - forward)
            mine = codes(source.read(at + forward, at + forward + n), dtype, unit.dtype)
            theirs = unit.source.read(unit_at + forward, unit_at + forward + n).view(mine.dtype)
            differ = np.flatnonzero(mine != theirs)
            if differ.size:
                return back, forward + int(differ[0])
            forward += n
        return back, forward

    def locate(self, source: Any, dtype: str = "float32") -> list[Run]:
        """The runs of model weights' values in `source`, in order."""
        runs: list[Run] = []
        at, low, probe = 0, 0, PROBE
        while at < source.numel:
            stop = min(source.numel, at + probe + K - 1)
            hit, cands = self._first_hit(source.read(at, stop), dtype)
            if hit < 0:
                if stop == source.numel:
                    break
                at, probe = stop - K + 1, min(probe * 4, WINDOW)
                continue
            pos, best = at + hit, None
            for uid, unit_at in cands:
                unit = self.units[self.names[uid]]
                back, forward = self._extent(source, dtype, pos, unit, unit_at, low)
                if best is None or back + forward > best[1] + best[2]:
                    best = (self.names[uid], back, forward, unit_at)
            name, back, forward, unit_at = best  # type: ignore[misc]
            if back + forward < K:  # fingerprints alike, values not: no match
                at += hit + 1
                continue
            runs.append(Run(name, pos - back, pos + forward, unit_at - back))
            at = low = pos + forward
            probe = PROBE
        return runs


def equal(source: Any, unit: Any) -> bool:
    """Whether the saved main param `source`, cast to the model dtype, is exactly the weight."""
    if source.numel != unit.numel or unit.dtype not in CHECKED:
        return False
    for start in range(0, unit.numel, WINDOW):
        stop = min(unit.numel, start + WINDOW)
        mine = codes(source.read(start, stop), source.dtype, unit.dtype)
        if not np.array_equal(mine, unit.source.read(start, stop).view(mine.dtype)):
            return False
    return True


def zero_tail(source: Any) -> int:
    """How many exact zeros end the tensor (0 if all of it is zero: nothing to tell)."""
    count, stop = 0, source.numel
    while stop > 0:
        start = max(0, stop - WINDOW)
        nonzero = np.flatnonzero(to_float32(source.read(start, stop), source.dtype) != 0)
        if nonzero.size:
            return count + (stop - start - 1 - int(nonzero[-1]))
        count += stop - start
        stop = start
    return 0


def digest(unit: Any, target: str) -> tuple[int, int, int]:
    """A fingerprint of a whole weight's values cast to `target` (numel, two sums)."""
    total = np.zeros(2, np.uint64)
    for start in range(0, unit.numel, WINDOW):
        c = codes(unit.source.read(start, min(unit.numel, start + WINDOW)), unit.dtype, target)
        c = c.astype(np.uint64)
        total[0] += (c * _MULT[np.arange(c.size) % K]).sum(dtype=np.uint64)
        total[1] += (c * c).sum(dtype=np.uint64)
    return unit.numel, int(total[0]), int(total[1])
