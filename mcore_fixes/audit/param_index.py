"""param-index and reshard-padding: DistributedOptimizer state against the model weights
(distopt-mixed-precision-groups's param index, upstream #5077's shifted offsets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .ckptread import Opaque, walk
from .locate import SIXTEEN, Index, digest, equal, zero_tail
from .reader import Unit, View
from .report import CANNOT_TELL, DAMAGED, OK, Verdict, _names, _where

KNOWN_SHARDING = (
    "dp_reshardable",
    "fully_reshardable",
    "dp_zero_gather_scatter",
    "fully_sharded_model_space",
    "fully_sharded_bucket_space",
    "fsdp_dtensor",
)
MAIN_KEYS = ("param", "fp32_param")  # the main (fp32) param among the saved state keys
# What the fork saves wrapped with its layout record ({"param_index_layout": .., key: value})
# where an earlier version's index would misread the checkpoint: that version then fails.
GUARDED = ("param_state_sharding_type", "per_bucket_numel_unpadded", "numel_unpadded")

# --- param index and reshard padding --------------------------------------------------------


@dataclass
class Records:
    """What the DistributedOptimizers wrote about themselves (common state, legacy files)."""

    layouts: list[tuple[str, str]] = field(default_factory=list)  # (where, param_index_layout)
    sharding: list[tuple[str, str]] = field(default_factory=list)  # (where, sharding type)
    # Values the fork saves wrapped with the layout ({"param_index_layout": .., key: value}) so
    # that earlier versions, whose index would misread the checkpoint, fail to load it.
    wrapped: list[str] = field(default_factory=list)
    args: Any = None


def _records(view: View) -> Records:
    rec = Records()
    for where, obj in view.objects:
        if where == "args" and isinstance(obj, Opaque) and rec.args is None:  # torch DCP
            rec.args = obj
        if isinstance(obj, str):  # a ShardedObject of one entry (non-reshardable formats, MIMO)
            if where.endswith(".param_state_sharding_type"):
                rec.sharding.append((where, obj))
            elif where.endswith(".param_index_layout"):
                rec.layouts.append((where, obj))
        for path, value in walk(obj):
            key = path[-1] if path else where.rsplit(".", 1)[-1]  # a ShardedObject: its key
            if key in GUARDED and isinstance(value, dict) and "param_index_layout" in value:
                rec.wrapped.append(str(key))
            if not path:
                continue
            if path[-1] == "param_index_layout" and isinstance(value, str):
                rec.layouts.append((_where(where, path[:-1]), value))
            elif path[-1] == "param_state_sharding_type" and isinstance(value, str):
                rec.sharding.append((_where(where, path[:-1]), value))
            elif path[-1] == "args" and isinstance(value, Opaque) and rec.args is None:
                rec.args = value
    return rec


def _sharding_name(value: str) -> str:
    """The known format a sharding type names (the fork may extend the name it writes)."""
    for known in sorted(KNOWN_SHARDING, key=len, reverse=True):
        if known in value:
            return known
    return value


def _class(dtype: str | None) -> str:
    return "fp32" if dtype == "float32" else "16-bit" if dtype in SIXTEEN else str(dtype)


@dataclass
class Located:
    """Where the saved main params were found among the model weights."""

    moved: list[str] = field(default_factory=list)  # saved under another param
    shifted: list[str] = field(default_factory=list)  # own param, from a shifted offset
    padded: list[str] = field(default_factory=list)  # own param, ending in zeros
    unexplained: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # buffers of other dtypes (FP8)
    own: int = 0
    checked: int = 0
    found: set[str] = field(default_factory=set)


class Audit:
    """One checkpoint's view, records, and (computed once, when a check needs them) the index
    of its model weights and where its main params are."""

    def __init__(self, view: View):
        self.view = view
        self.rec = _records(view)
        self.formats = sorted(
            {_sharding_name(s) for _, s in self.rec.sharding}
            | {r.sharding for r in view.regions if r.sharding}
        )
        # DistributedOptimizer main params: a non-distributed optimizer saves its fp32 copies
        # under the same model-space keys, but has no param index (and no sharding type).
        self.mains = [
            r for r in view.regions if r.state in MAIN_KEYS and (r.buffer or self.formats)
        ]
        self._index: Index | None = None
        self._located: Located | None = None

    def index(self) -> Index:
        if self._index is None:
            self._index = Index(self.view.units)
        return self._index

    def located(self) -> Located:
        if self._located is None:
            self._located = self._locate()
        return self._located

    def _locate(self) -> Located:
        view, loc = self.view, Located()
        moments = {(r.optimizer, r.owner): r for r in view.regions if r.state == "exp_avg_sq"}
        for region in self.mains:
            if (not region.buffer and region.owner is None) or region.padding():
                continue  # model space without its model weight; padding
            if region.buffer and _class(region.buffer_dtype) not in ("fp32", "16-bit"):
                loc.skipped.append(f"{region.optimizer} ({region.buffer}, {region.buffer_dtype})")
                continue  # FP8 buffers: their model weights are not what the main params cast to
            loc.checked += 1
            if region.buffer:  # buffer space: whose main params does it hold?
                for run in self.index().locate(region.source, region.source.dtype):
                    unit = view.units[run.unit]
                    loc.found.add(unit.name)
                    if _class(unit.dtype) != _class(region.buffer_dtype):
                        loc.moved.append(
                            f"the {_class(region.buffer_dtype)} buffer of {region.optimizer} "
                            f"({region.buffer}) holds the main param of {_class(unit.dtype)} "
                            f"{unit.name}"
                        )
                continue
            unit = view.units[region.owner]  # model space: it belongs to its owner
            if equal(region.source, unit):
                loc.own += 1
                loc.found.add(unit.name)
                continue
            runs = self.index().locate(region.source, region.source.dtype)
            # Another param's main param at the same offsets, over most of the region: saved
            # through another param's index entry. Anything else off its place: read from a
            # shifted offset (own values moved by k elements, the next param's first ones).
            half = region.source.numel // 2
            moved = sorted(
                {
                    r.unit
                    for r in runs
                    if r.unit != unit.name and r.unit_start == r.start and r.end - r.start >= half
                }
            )
            shifts = sorted({r.unit_start - r.start for r in runs if r.unit == unit.name} - {0})
            spill = sorted({r.unit for r in runs if r.unit != unit.name} - set(moved))
            tail = zero_tail(region.source)
            loc.found.update(moved)
            if moved:
                loc.moved.append(f"{unit.name} holds the main param of {_names(moved, 2)}")
            elif shifts or spill or tail:
                sq = moments.get((region.optimizer, region.owner))
                sq_tail = zero_tail(sq.source) if sq is not None else 0
                what = [f"shifted by {shifts[0]} elements"] if shifts else []
                what += [f"holds the first elements of {_names(spill, 1)}"] if spill else []
                what += [f"last {tail} of {unit.numel} elements zero"] if tail else []
                what += [f"exp_avg_sq's last {sq_tail} zero"] if sq_tail else []
                shifted = shifts or spill
                (loc.shifted if shifted else loc.padded).append(f"{unit.name} ({', '.join(what)})")
            else:
                loc.unexplained.append(unit.name)
        return loc

    def buffers_aligned(self) -> bool | None:
        """Buffer space: whether every optimizer's fp32 grad buffers precede its 16-bit ones
        (then every MCore version indexes its groups alike); None in model space."""
        order: dict[str, set[tuple[int, str]]] = {}
        for r in self.mains:
            if r.buffer_dtype is not None:
                gbuf = int(r.buffer.split()[1])
                order.setdefault(r.optimizer, set()).add((gbuf, _class(r.buffer_dtype)))
        if not order:
            return None
        for buffers in order.values():
            classes = [c for _, c in sorted(buffers)]
            if "fp32" in classes and "16-bit" in classes:
                last_fp32 = max(i for i, c in enumerate(classes) if c == "fp32")
                if last_fp32 > classes.index("16-bit"):
                    return False
        return True

    def owners(self) -> set[str]:
        """The model weights the DistributedOptimizers hold main params of (all weights, in
        buffer space, where a file does not say)."""
        return {r.owner for r in self.mains if r.owner} or set(self.view.units)

    def hidden(self) -> list[str]:
        """fp32 and 16-bit params a swap of main params would not show in."""
        owners, loc = self.owners(), self.located()
        if any(not r.buffer for r in self.mains):  # model space: values that coincide
            return _coincident(self.view, owners)
        # Buffer space: a swap puts a 16-bit main param in an fp32 buffer and an fp32 one in a
        # 16-bit buffer; it hides only where both cannot be located by value.
        missing = sorted(n for n in owners if n not in loc.found)
        kinds = {_class(self.view.units[n].dtype) for n in missing}
        return missing if {"fp32", "16-bit"} <= kinds else []


def _coincident(view: View, owners: set[str]) -> list[str]:
    """fp32 and 16-bit weights whose values coincide (cast to 16 bits)."""
    by_value: dict[tuple, list[Unit]] = {}
    units = [view.units[n] for n in sorted(owners)]
    sixteen = next((u.dtype for u in units if u.dtype in SIXTEEN), "bfloat16")
    for unit in units:
        if _class(unit.dtype) in ("fp32", "16-bit"):
            by_value.setdefault(digest(unit, sixteen), []).append(unit)
    return [
        " = ".join(u.name for u in units)
        for units in by_value.values()
        if {"fp32", "16-bit"} <= {_class(u.dtype) for u in units}
    ]


FORK_CONVERTS = (
    "reads it in grad-buffer order, as it was written (it has no layout record), so each param "
    "gets its own main param and moments back, and says so"
)
UNRECORDED_TODO = (
    "resume with the fork; if the fork before its layout record or upstream dev wrote it, set "
    "unrecorded_param_index_layout='storage_order' in the optimizer config."
)
FORK_UNRECORDED = (
    "reads it in grad-buffer order (the layout of every release) and says so; "
    "the optimizer config's unrecorded_param_index_layout='storage_order' overrides that for a "
    "checkpoint the fork (before it recorded its layout) or upstream dev wrote"
)


def check_param_index(a: Audit) -> Verdict:
    name, view, rec = "param-index", a.view, a.rec
    evidence: dict[str, Any] = {"formats": a.formats, "records": dict(rec.layouts)}
    if not a.mains:
        if "fsdp_dtensor" in a.formats:
            return Verdict(
                name,
                OK,
                "a Megatron-FSDP checkpoint (fsdp_dtensor): it has no "
                "DistributedOptimizer param index.",
                evidence,
            )
        if a.formats:
            return Verdict(
                name,
                CANNOT_TELL,
                f"DistributedOptimizer state in format "
                f"{_names(a.formats)}, whose main params the audit does not read.",
                evidence,
                todo="if a group mixes fp32 and 16-bit params, resume with the fork: it loads "
                "the releases' layout and records its own from then on.",
            )
        return Verdict(
            name,
            OK,
            "no DistributedOptimizer state: nothing was saved through its param index.",
            evidence,
        )
    if not view.units or not any(r.buffer or r.owner for r in a.mains):
        return Verdict(
            name,
            CANNOT_TELL,
            "the checkpoint holds no model weights to compare the "
            "saved main params with (an optimizer-only save).",
            evidence,
            todo="audit a checkpoint of the same run that holds the model weights too.",
        )
    loc = a.located()
    classes = {_class(view.units[o].dtype) for o in a.owners()}
    mixed = {"fp32", "16-bit"} <= classes
    aligned = a.buffers_aligned()
    tripwire = sorted({s for _, s in rec.sharding if s not in KNOWN_SHARDING})
    marked = sorted({v for _, v in rec.layouts})
    not_located = sorted(n for n in a.owners() if n not in loc.found)
    evidence.update(
        not_located=not_located,
        fp8_buffers_not_checked=loc.skipped,
        main_param_tensors=loc.checked,
        own=loc.own,
        moved=loc.moved,
        unexplained=loc.unexplained,
        mixed_dtypes=mixed,
        fp32_buffers_first=aligned,
        sharding_types=sorted({s for _, s in rec.sharding}),
        wrapped_with_the_record=sorted(set(rec.wrapped)),
    )
    if loc.moved:
        if marked:
            return Verdict(
                name,
                DAMAGED,
                f"the checkpoint records layout {_names(marked)}, yet {len(loc.moved)} saved main "
                "param(s) belong to other params.",
                evidence,
                fork="loads it as recorded, so permuted",
                stock="loads it permuted",
                details=loc.moved,
                todo="resume with --no-load-optim (the model weights) or from an earlier "
                "checkpoint.",
            )
        return Verdict(
            name,
            DAMAGED,
            f"{len(loc.moved)} saved main param(s) belong to other params: saved through the "
            "grad-buffer-order param index of unpatched MCore (distopt-mixed-precision-groups: a "
            "group mixing fp32 and 16-bit params); their moments moved with them.",
            evidence,
            details=loc.moved,
            todo="resume with the fork (it gives each param its own state back) or the release "
            "that wrote it; convert it with no tool that reads it by model order.",
            fork=FORK_CONVERTS,
            stock="reads it back through the same index (its own round trip is exact); any other "
            "reader gets other params' state",
        )
    if marked:
        wrapped = sorted(set(rec.wrapped))
        stock = (
            f"fails to load it (an error): the fork saved {_names(wrapped)} wrapped with the "
            "record, which earlier versions cannot read (they fail rather than misread a group "
            "mixing fp32 and 16-bit params)"
            if wrapped
            else f"refuses it: its sharding type {tripwire[0]!r} is unknown there"
            if tripwire
            else "loads it exactly: its index is the same for these groups"
        )
        refused = bool(wrapped or tripwire)
        return Verdict(
            name,
            OK,
            f"recorded layout {_names(marked)} (written by the fork); every "
            f"main param is its own param's ({loc.checked} tensor(s) checked)."
            + (" Stock megatron-core will refuse this checkpoint." if refused else ""),
            evidence,
            fork="loads it as recorded",
            stock=stock,
            todo="stock megatron-core will refuse this checkpoint's optimizer state: keep "
            "resuming with the fork (README: Going back to upstream), or start stock from its "
            "model weights only (--no-load-optim)."
            if refused
            else "",
        )
    if not mixed or aligned:
        why = (
            "no DistributedOptimizer group mixes fp32 and 16-bit params"
            if not mixed
            else "every optimizer's fp32 grad buffers precede its 16-bit ones"
        )
        return Verdict(
            name,
            OK,
            f"{why}: every MCore version indexes it alike "
            f"({loc.checked} main param tensor(s) checked).",
            evidence,
            fork="loads it exactly",
            stock="loads it exactly",
        )
    hidden = a.hidden()
    evidence["coincide"] = hidden
    if hidden:
        return Verdict(
            name,
            CANNOT_TELL,
            "storage order or grad-buffer order: the values cannot tell, fp32 and 16-bit params "
            "coincide.",
            evidence,
            fork=FORK_UNRECORDED,
            stock="loads it exactly if stock wrote it",
            details=[f"equal values: {h}" for h in hidden],
            todo=UNRECORDED_TODO,
        )
    if loc.unexplained:
        return Verdict(
            name,
            CANNOT_TELL,
            f"{len(loc.unexplained)} saved main param(s) match no model weight in either order "
            "(FP8 params, weights changed after the optimizer state, e.g. QK-clip, or another "
            "bug).",
            evidence,
            fork=FORK_UNRECORDED,
            details=loc.unexplained,
            todo=UNRECORDED_TODO,
        )
    return Verdict(
        name,
        OK,
        f"storage order: every main param is its own param's ({loc.checked} tensor(s) checked), "
        "no layout record.",
        evidence,
        details=[
            "stock releases write this only where no optimizer group mixes fp32 and 16-bit "
            "params; the fork before it recorded its layout and upstream dev (#5835) write it "
            "for every group"
        ],
        fork="loads it exactly (its 16-bit main params fit storage order only)",
        stock="(releases, main) loads it exactly if it wrote it; one the fork or dev wrote it "
        "reads permuted where a group mixes fp32 and 16-bit params, silently",
    )


def check_reshard_padding(a: Audit) -> Verdict:
    name, view = "reshard-padding", a.view
    evidence: dict[str, Any] = {"formats": a.formats}
    if a.rec.args is not None:
        keys = ("overlap_grad_reduce", "ddp_bucket_size", "dist_ckpt_optim_fully_reshardable")
        evidence["args"] = {k: a.rec.args.get(k) for k in keys}
    model_space = [r for r in a.mains if not r.buffer]
    if "fully_reshardable" not in a.formats or not model_space:
        return Verdict(
            name, OK, "not a fully_reshardable checkpoint: only that format is affected.", evidence
        )
    if not any(r.owner for r in model_space):
        moments = [r for r in view.regions if r.state == "exp_avg_sq"]
        zeros = sum(1 for r in moments if zero_tail(r.source))
        return Verdict(
            name,
            CANNOT_TELL,
            "the checkpoint holds no model weights to compare the "
            "saved main params with"
            + (f"; the exp_avg_sq of {zeros} param(s) ends in zeros" if zeros else "")
            + ".",
            evidence,
            todo="audit a checkpoint of the same run that holds the model weights too"
            + ("; if it cannot tell either, resume with --no-load-optim" if zeros else "")
            + ".",
        )
    loc = a.located()
    evidence.update(main_params=loc.checked, own=loc.own, shifted=loc.shifted, padded=loc.padded)
    damaged = loc.shifted + loc.padded
    if damaged:
        return Verdict(
            name,
            DAMAGED,
            f"{len(damaged)} of {loc.checked} params saved from a wrong offset (upstream #5077, a "
            "model in several buckets); their moments alike.",
            evidence,
            fork="restores the state as saved (the fix prevents new damage, it cannot repair this "
            "checkpoint)",
            stock="restores the state as saved",
            details=damaged,
            todo="resume with --no-load-optim (the model weights only); the fork saves without "
            "this damage from then on.",
        )
    others = f", {len(loc.moved)} under other params (see param-index)" if loc.moved else ""
    return Verdict(
        name,
        OK,
        f"no saved main param shifted or zero-padded ({loc.checked} checked: {loc.own} equal "
        f"their model weights{others}).",
        evidence,
    )
