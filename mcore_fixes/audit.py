"""`audit`: does a Megatron checkpoint carry the damage of the bugs this series fixes?

One verdict per check: `ok`, `damaged` (with the evidence) or `cannot tell` (and why).

- loss-scale (chained-loss-scale, mimo-loss-scale): every dynamic loss scaler the checkpoint
  saved (dense and expert chains of a ChainedOptimizer, MIMO module optimizers) must hold the
  same (scale, growth_tracker, hysteresis_tracker); unpatched MCore lets them diverge.
- param-index (the distopt-* fix): which DistributedOptimizer param index wrote the state. The
  layout record where the checkpoint has one; otherwise from values: the main param of a
  16-bit param, cast to the model dtype, is its model weight, and an fp32 param's main param
  is its weight. So each saved main param is located among the saved model weights: under its
  own param (storage order, or a group already aligned), under another param (the
  grad-buffer-order index of unpatched MCore), both (values coincide) or none.
- reshard-padding (upstream #5077): `fully_reshardable` saves of a model spanning several
  buckets read every param past the first bucket from a shifted offset and pad the last ones
  with zeros: saved main params equal their weights shifted, or end in a run of exact zeros
  (so do exp_avg and exp_avg_sq).

Reading is lazy and windowed (mcore_fixes.ckptread, mcore_fixes.locate) and needs numpy, not
torch: the peak memory is a few windows plus a fingerprint table of the model weights (20 bytes
per 64 elements, 80 MiB at most), whatever the checkpoint's size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .audit_resume import group_findings, param_groups, scheduler_state, step_counts
from .ckptread import (
    FLOATS,
    BadCheckpoint,
    DistCheckpoint,
    DistItem,
    Files,
    LazyTensor,
    Opaque,
    TorchDType,
    load_file,
    walk,
)
from .errors import UserError
from .locate import SIXTEEN, Index, digest, equal, zero_tail

OK, DAMAGED, CANNOT_TELL = "ok", "damaged", "cannot tell"
TRACKER = "latest_checkpointed_iteration.txt"
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
SHOWN = 4  # params named in a text line; --json lists all
# What values of a kind Megatron never writes raise where a check meets them
MALFORMED = (RecursionError, ValueError, OverflowError, TypeError, AttributeError, LookupError)

_MODEL_SPACE = re.compile(r"^(?P<opt>.*?)optimizer\.state\.(?P<state>[^.]+)\.(?P<key>.+)$")
_BUFFER_SPACE = re.compile(
    r"^(?P<opt>.*?)optimizer\.distributed\.dp_group_idx_(?P<dp>\d+)\.gbuf_idx_(?P<g>\d+)"
    r"\.dtype_(?P<dtype>.+)\.bucket_idx_(?P<b>\d+)\.(?P<state>[^.]+)$"
)
_DTYPE_NAME = re.compile(r"torch\.(\w+)")
_ITERATION = re.compile(r"[0-9]{1,12}")  # ASCII digits: what megatron/training writes
TRACKER_MAX = 64  # bytes of the tracker file


# --- what a checkpoint holds ------------------------------------------------------------


@dataclass
class Unit:
    """A saved model weight (one chunk of a key): what main params are compared with."""

    name: str
    dtype: str
    source: Any  # LazyTensor or RawTensor: numel, dtype, read(start, stop)

    @property
    def numel(self) -> int:
        return self.source.numel


@dataclass
class Region:
    """Saved DistributedOptimizer state: one tensor (chunk) of one state key."""

    optimizer: str  # which optimizer saved it (prefix, data-parallel group, file)
    state: str  # "param" / "fp32_param" (main params), "exp_avg", "exp_avg_sq", ...
    source: Any  # LazyTensor or RawTensor
    owner: str | None = None  # model space: the unit it belongs to
    buffer_dtype: str | None = None  # buffer space: param dtype of the grad buffer
    buffer: str = ""  # buffer space: which buffer (and bucket); "" in model space
    sharding: str = ""  # the format that wrote it
    base: int = 0  # dp_reshardable: where the chunk starts in its bucket
    key: str = ""  # model space: the rest of the key (a param name, or a state key)

    def padding(self) -> bool:
        """A dp_reshardable chunk of the gap between two params (params start 64-aligned):
        MCore saves it from uninitialized memory, which may hold copies of any param."""
        end = self.base + self.source.numel
        return (
            self.sharding == "dp_reshardable"
            and self.source.numel < 64
            and (self.base % 64 != 0 and end % 64 == 0)
        )


@dataclass
class View:
    path: Path
    kind: str  # "torch_dist" | "torch"
    iteration: int | str | None
    objects: list[tuple[str, Any]] = field(default_factory=list)  # (where, unpickled object)
    units: dict[str, Unit] = field(default_factory=dict)
    regions: list[Region] = field(default_factory=list)
    note: str = ""


def _dtype_of(text: str) -> str | None:
    m = _DTYPE_NAME.search(text)
    return m.group(1) if m else None


def _param_dtype(key: Any) -> str | None:
    """The param dtype of a grad buffer key: a dtype or (param_dtype, grad_dtype)."""
    if isinstance(key, TorchDType):
        return str(key)
    if isinstance(key, tuple) and key and isinstance(key[0], TorchDType):
        return str(key[0])
    return _dtype_of(str(key))


def _unwrap(obj: Any) -> Any:
    """A ShardedObject's value is saved as a one-element list."""
    while isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    return obj


def _dp_zero_regions(state: Any, optimizer: str, sharding: str) -> list[Region]:
    """Regions of a dp_zero parameter state ({gbuf_idx: {dtype: {"param": world tensor}}})."""
    regions = []
    for gbuf, per_dtype in state.items() if isinstance(state, dict) else ():
        if not isinstance(per_dtype, dict) or isinstance(gbuf, str):
            continue
        for dtype_key, tensors in per_dtype.items():
            if not isinstance(tensors, dict):
                continue
            for state_key, tensor in tensors.items():
                if isinstance(tensor, LazyTensor):
                    regions.append(
                        Region(
                            optimizer,
                            str(state_key),
                            tensor,
                            None,
                            _param_dtype(dtype_key),
                            f"gbuf {gbuf}",
                            sharding,
                        )
                    )
    return regions


def _dist_view(files: Files, root: Path) -> View:
    ckpt = DistCheckpoint(files, root)
    view = View(root, "torch_dist", None)
    if (root / "common.pt").exists():
        view.objects.append(("common.pt", load_file(files, root / "common.pt")))
    model_space: list[tuple[re.Match, DistItem]] = []
    for key, item in ckpt.items.items():
        if item.dtype is None:
            if "_extra_state" in key:  # Transformer Engine's per-layer state: not ours
                continue
            obj = _unwrap(ckpt.object(item))
            where = key.split("/shard_")[0]
            view.objects.append((where, obj))
            if where.endswith(".param_state") and isinstance(obj, dict):
                view.regions += _dp_zero_regions(
                    obj, where[: -len(".param_state")], "dp_zero_gather_scatter"
                )
            continue
        if (m := _BUFFER_SPACE.match(key)) is not None:
            for chunk in item.chunks:
                view.regions.append(
                    Region(
                        f"{m['opt']}dp_group_idx_{m['dp']}",
                        m["state"],
                        ckpt.tensor(item, chunk),
                        None,
                        _dtype_of(m["dtype"]),
                        f"gbuf {m['g']} bucket {m['b']}",
                        "dp_reshardable",
                        chunk.offsets[0],
                    )
                )
        elif (m := _MODEL_SPACE.match(key)) is not None:
            model_space.append((m, item))
        elif item.dtype in FLOATS:
            for chunk in item.chunks:
                name = key if len(item.chunks) == 1 else f"{key}{list(chunk.offsets)}"
                view.units[name] = Unit(name, item.dtype, ckpt.tensor(item, chunk))
    for m, item in model_space:
        model = ckpt.items.get(m["key"])
        for chunk in item.chunks:
            owner = None
            if model is not None:
                name = m["key"] if len(model.chunks) == 1 else f"{m['key']}{list(chunk.offsets)}"
                owner = name if name in view.units else None
            region = Region(m["opt"].rstrip("."), m["state"], ckpt.tensor(item, chunk), owner)
            region.key = m["key"]
            view.regions.append(region)
    for where, obj in view.objects:
        if where == "iteration" and isinstance(obj, int):  # torch DCP (fsdp_dtensor) saves
            view.iteration = _iteration(obj, where)
        if where in ("common_state", "common.pt"):
            # megatron/training saves it at the top (args may hold an `iteration` of its own)
            it = obj.get("iteration") if isinstance(obj, dict) else None
            if isinstance(it, int) and not isinstance(it, bool):
                view.iteration = _iteration(it, where)
    return view


def _legacy_view(files: Files, root: Path, ranks: list[Path]) -> View:
    view = View(root, "torch", None)
    for rank_dir in ranks:
        label = rank_dir.name if rank_dir != root else root.name
        model_file = rank_dir / "model_optim_rng.pt"
        if not model_file.exists():
            raise BadCheckpoint(f"{model_file} is missing")
        obj = load_file(files, model_file)
        if not isinstance(obj, dict):
            raise BadCheckpoint(f"{model_file}: not a Megatron checkpoint (no state dict)")
        view.objects.append((f"{label}/model_optim_rng.pt", obj))
        if isinstance(obj.get("iteration"), int):
            view.iteration = _iteration(obj["iteration"], model_file)
        chunks = [k for k in obj if isinstance(k, str) and re.fullmatch(r"model\d*", k)]
        for chunk in chunks:
            for key, tensor in (obj[chunk] if isinstance(obj[chunk], dict) else {}).items():
                if isinstance(tensor, LazyTensor) and tensor.dtype in FLOATS:
                    prefix = f"{chunk}." if len(chunks) > 1 else ""
                    name = f"{label}:{prefix}{key}"
                    view.units[name] = Unit(name, tensor.dtype, tensor)
        optim_file = rank_dir / "distrib_optim.pt"
        args = obj.get("args")
        if (
            not optim_file.exists()
            and isinstance(args, Opaque)
            and args.get("use_distributed_optimizer")
            and not args.get("no_save_optim")
        ):
            raise BadCheckpoint(f"{optim_file} is missing (the run used the distributed optimizer)")
        if optim_file.exists():
            state = load_file(files, optim_file)
            view.objects.append((f"{label}/distrib_optim.pt", state))
            states = state if isinstance(state, list) else [state]
            for i, one in enumerate(states):
                name = f"{label}:optimizer" + (f"[{i}]" if len(states) > 1 else "")
                view.regions += _dp_zero_regions(one, name, "legacy")
    return view


def _iteration(value: int, where: Any) -> int:
    """A saved iteration number, refused where no run could have reached it."""
    if not 0 <= value < 10**12:
        raise BadCheckpoint(f"{where}: its iteration is not an iteration number (out of range)")
    return value


def _iteration_dirs(root: Path) -> list[Path]:
    found = [p for p in root.glob("iter_*") if _ITERATION.fullmatch(p.name[5:]) and p.is_dir()]
    return sorted(found)


def resolve(path: Path) -> tuple[Path, str]:
    """The iteration directory to audit and a note on how it was found."""
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if not path.is_dir():
        raise UserError(f"{path} is a file: give the checkpoint directory (the one holding it)")
    tracker = path / TRACKER
    if tracker.is_file():
        files = Files(path)
        try:
            text = files.read(tracker, TRACKER_MAX).decode("utf-8", "replace").strip()
        finally:
            files.close()
        number = _ITERATION.fullmatch(text)
        name = "release" if text == "release" else f"iter_{int(text):07d}" if number else ""
        if not name:
            raise UserError(
                f"{tracker}: expected an iteration number or 'release', got {text[:40]!r}"
            )
        target = path / name
        if not target.is_dir():
            raise UserError(f"{tracker} names {name}, which is not in {path}")
        return target, f"latest checkpoint, from {TRACKER}"
    if not _is_iteration(path) and (found := _iteration_dirs(path)):
        return found[-1], f"the highest iteration directory (no {TRACKER})"
    if not _is_iteration(path) and (runs := _runs(path)):
        shown = ", ".join(str(r) for r in runs[:8]) + (" ..." if len(runs) > 8 else "")
        raise UserError(
            f"{path} holds the save directories of {len(runs)} runs: audit each one: {shown}"
        )
    return path, ""


def _runs(path: Path) -> list[Path]:
    """Save directories (a tracker file or iteration directories) one level below `path`."""
    return sorted(
        p
        for p in path.iterdir()
        if p.is_dir() and not p.is_symlink() and ((p / TRACKER).is_file() or _iteration_dirs(p))
    )


def _is_iteration(path: Path) -> bool:
    return (
        (path / ".metadata").exists()
        or (path / "metadata.json").exists()
        or any(path.glob("*.distcp"))
        or (path / "common.pt").exists()
        or (path / "model_optim_rng.pt").exists()
        or any(path.glob("mp_rank_*"))
    )


def read_view(path: Path, files: Files) -> View:
    root, note = resolve(path)
    files.root = root  # every file read is inside it
    if not any(root.iterdir()):
        raise UserError(f"{root} is empty: not a Megatron checkpoint")
    if (
        (root / "metadata.json").exists()
        or (root / ".metadata").exists()
        or any(root.glob("*.distcp"))
    ):
        if not (root / ".metadata").exists():
            raise BadCheckpoint(f"{root} has no .metadata: the save did not finish (truncated)")
        backend = _read_json(files, root / "metadata.json").get("sharded_backend", "torch_dist")
        backend = backend[:40] if isinstance(backend, str) else type(backend).__name__
        if backend != "torch_dist":
            raise UserError(f"{root}: a {backend} checkpoint; audit reads torch_dist and torch")
        view = _dist_view(files, root)
    elif (root / "model_optim_rng.pt").exists():
        view = _legacy_view(files, root, [root])
    elif ranks := sorted(p for p in root.glob("mp_rank_*") if p.is_dir()):
        view = _legacy_view(files, root, ranks)
    else:
        raise UserError(
            f"{root} is not a Megatron checkpoint (no .metadata of torch_dist, no "
            f"mp_rank_*/model_optim_rng.pt, no {TRACKER})"
        )
    if view.iteration is None and _ITERATION.fullmatch(root.name.removeprefix("iter_")):
        view.iteration = int(root.name.removeprefix("iter_"))
    view.note = note
    return view


def _read_json(files: Files, path: Path) -> dict:
    import json

    if not path.exists():
        return {}
    try:
        value = json.loads(files.read(path, 1 << 20))
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


# --- verdicts ----------------------------------------------------------------------------


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


def _scale_value(value: Any) -> float | None:
    if isinstance(value, LazyTensor):
        return value.item() if value.numel >= 1 else None
    if isinstance(value, float) or (isinstance(value, int) and abs(value) < 2**64):
        return float(value)
    return None


def _tracker_value(value: Any) -> int | None:
    """A scaler's growth or hysteresis tracker as an int (None: not a count)."""
    number = _scale_value(value)
    return int(number) if number is not None and math.isfinite(number) else None


def _grad_scalers(view: View) -> list[tuple[str, tuple[float, int, int]]]:
    found = []
    for where, obj in view.objects:
        for path, value in walk(obj):
            if isinstance(value, dict) and {"scale", "growth_tracker", "hysteresis_tracker"} <= set(
                value
            ):
                scale = _scale_value(value["scale"])
                growth = _tracker_value(value["growth_tracker"])
                hysteresis = _tracker_value(value["hysteresis_tracker"])
                if scale is None or growth is None or hysteresis is None:
                    continue
                state = (scale, growth, hysteresis)
                found.append((_where(where, path), state))
    return found


def _fmt_scaler(state: tuple[float, int, int]) -> str:
    scale, growth, hysteresis = state
    return f"scale {scale:g}, growth_tracker {growth}, hysteresis_tracker {hysteresis}"


def check_loss_scale(view: View) -> Verdict:
    scalers = _grad_scalers(view)
    evidence = {
        "scalers": [
            {"where": w, "scale": s[0], "growth_tracker": s[1], "hysteresis_tracker": s[2]}
            for w, s in scalers
        ]
    }
    if not scalers:
        return Verdict(
            "loss-scale",
            OK,
            "no dynamic loss scaler saved (BF16/FP32 training or a "
            "constant loss scale): nothing can diverge.",
            evidence,
        )
    states = {s for _, s in scalers}
    if len(states) == 1:
        (state,) = states
        return Verdict(
            "loss-scale",
            OK,
            f"{len(scalers)} dynamic loss scaler(s), all at ({_fmt_scaler(state)}).",
            evidence,
        )
    scales = sorted({s[0] for s in states})
    return Verdict(
        "loss-scale",
        DAMAGED,
        f"{len(scalers)} dynamic loss scalers of one run differ (scales "
        f"{', '.join(f'{s:g}' for s in scales)}): each optimizer backed off on its own "
        "overflows (fixes 4 and 1).",
        evidence,
        details=[f"{w}: {_fmt_scaler(s)}" for w, s in scalers]
        + ["gradients were unscaled by another scale than the loss was scaled with"],
        todo="resume with the fork: it reconciles the scalers (nothing else to do); the updates "
        "already taken with a wrong scale stay in the weights.",
        fork="reconciles them on load (a ChainedOptimizer) or at the first step (MIMO) to the "
        f"smallest scale ({scales[0]:g}), growth_tracker 0 and hysteresis reset, and warns once",
        stock="keeps them diverged",
    )


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
    "MCORE_UNRECORDED_PARAM_INDEX_LAYOUT=storage_order."
)
FORK_UNRECORDED = (
    "reads it in grad-buffer order (the layout of every release) and says so; "
    "MCORE_UNRECORDED_PARAM_INDEX_LAYOUT=storage_order overrides that for a checkpoint the fork "
    "(before it recorded its layout) or upstream dev wrote"
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
            "grad-buffer-order param index of unpatched MCore (fix 2, a group mixing fp32 and "
            "16-bit params); their moments moved with them.",
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


# --- param groups and step counts (what a resume leaves) ------------------------------------

GROUPS_TODO = (
    "resume from the last checkpoint saved before the first resume of this run (its groups are "
    "right) on megatron-core 0.19.0 or later, or the fork built on 0.19 (#4705 pairs the groups "
    "by their LR bounds too); this checkpoint's weights and moments are its own, its group "
    "settings are not (--no-load-optim keeps the weights only). The fork does not repair them."
)
OVERRIDE_TODO = (
    "the groups train at the earlier run's LR bounds, not your --lr/--min-lr: resume on a "
    "megatron-core with upstream #5213 (upstream dev) with --override-opt-param-scheduler, which "
    "sets them from the args; without #5213 no flag changes them (the fork does not carry it)."
)


def check_param_groups(a: Audit) -> Verdict:
    name, view = "param-groups", a.view
    found = param_groups(view.objects, _where)
    sched = scheduler_state(view.objects)
    args = a.rec.args
    evidence: dict[str, Any] = {"optimizers": len(found), "scheduler": sched}
    if not found:
        return Verdict(name, OK, "no optimizer param groups saved.", evidence)
    findings: dict[str, list[str]] = {}
    for groups in found:
        for kind, lines in group_findings(groups, sched, args).items():
            findings.setdefault(kind, []).extend(lines)
    evidence.update(findings)
    override = bool(args.get("override_opt_param_scheduler")) if isinstance(args, Opaque) else False
    if not findings:
        what = "LR bounds, weight decay and params" if sched else "settings and params"
        src = "the saved scheduler state" if sched else "each other (no scheduler state saved)"
        return Verdict(
            name,
            OK,
            f"{sum(len(g.groups) for g in found)} param group(s) of {len(found)} optimizer(s): "
            f"{what} agree with {src}.",
            evidence,
        )
    details = [line for lines in findings.values() for line in lines]
    if "duplicate" in findings or "params" in findings:
        return Verdict(
            name,
            DAMAGED,
            "param groups hold other groups' settings (upstream #4705: a resume of a run whose "
            "groups differ only in LR bounds, e.g. --decoupled-lr).",
            evidence,
            details=details,
            todo=GROUPS_TODO,
        )
    if "bounds" in findings and override:
        return Verdict(
            name,
            DAMAGED,
            "param groups kept LR bounds that the scheduler state and args replaced (upstream "
            "#5213: a resume with --override-opt-param-scheduler).",
            evidence,
            details=details,
            todo=OVERRIDE_TODO,
        )
    return Verdict(
        name,
        DAMAGED,
        "param groups disagree with the saved scheduler state (LR bounds or weight decay).",
        evidence,
        details=details,
        todo="check the args this run was resumed with; "
        + (OVERRIDE_TODO if "bounds" in findings else GROUPS_TODO),
    )


STEP_TODO = (
    "Adam's bias corrections run ahead: resume with the fork, which gives each param its own "
    "step on load but keeps the saved count (the count itself cannot be repaired), or from a "
    "checkpoint before the resume; --no-load-optim restarts the moments and the count."
)
FSDP_TODO = (
    "one update was taken before training (0.74x the first real update; with weight decay the "
    "weights moved before training): the count cannot be repaired; new runs with the fork or "
    "megatron-core with #5976 (upstream main) do not take it."
)


def check_step(a: Audit) -> Verdict:
    name, view = "step", a.view
    steps = step_counts(view.objects, view.regions, _where)
    it = view.iteration if isinstance(view.iteration, int) else None
    evidence: dict[str, Any] = {"iteration": it, "steps": dict(steps[:64]), "counts": len(steps)}
    if not steps:
        return Verdict(name, OK, "no optimizer step count saved (e.g. SGD).", evidence)
    values = sorted({s for _, s in steps})
    if it is None:
        return Verdict(
            name,
            CANNOT_TELL,
            f"step counts {_names([f'{v:g}' for v in values])}, but no iteration number saved.",
            evidence,
            todo="audit the iteration directory megatron/training wrote (iter_NNNNNNN).",
        )
    ahead = [(w, s) for w, s in steps if s > it]
    if not ahead:
        return Verdict(
            name,
            OK,
            f"{len(steps)} step count(s), at most the {it} iteration(s) trained "
            f"({_names([f'{v:g}' for v in values])}).",
            evidence,
        )
    details = [f"{w}: step {s:g}" for w, s in ahead]
    fsdp = (isinstance(a.rec.args, Opaque) and a.rec.args.get("use_megatron_fsdp")) or (
        "fsdp_dtensor" in a.formats
    )
    if all(s == it + 1 for _, s in ahead) and fsdp:
        return Verdict(
            name,
            DAMAGED,
            f"Adam's step count is {it + 1} after {it} iteration(s) (upstream #5976: "
            "Megatron-FSDP's fully_shard(model, optimizer) stepped once before training).",
            evidence,
            details=details,
            todo=FSDP_TODO,
        )
    return Verdict(
        name,
        DAMAGED,
        f"step counts up to {max(values):g} after {it} iteration(s): "
        + (
            "after a resume all params shared one step tensor, advanced once per param per "
            "iteration (fix 2's per-param step)."
            if a.formats
            else "more optimizer steps than iterations (a param in two param groups steps twice "
            "an iteration: see param-groups)."
        ),
        evidence,
        details=details,
        todo=STEP_TODO,
    )


# --- what loading does, where it was established ------------------------------------------

# Formats that do not carry torch Adam's per-param "step": stock megatron-core (every release,
# main, dev) fails to load them with torch Adam (fix 2, distopt-missing-state-key)
STEPLESS = ("fully_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter", "legacy")
FAILS = ("fails", "refuses")


def optimizer_flavour(view: View) -> str | None:
    """ "torch Adam" or "FusedAdam" (Transformer Engine, apex), from the saved param groups'
    keys (torch's optimizers save `foreach`/`differentiable`, the fused ones
    `bias_correction`); None where no group says."""
    for found in param_groups(view.objects, _where):
        keys = set().union(*(g.keys() for g in found.groups))
        if {"foreach", "differentiable"} & keys:
            return "torch Adam"
        if "bias_correction" in keys:
            return "FusedAdam"
    return None


def _established(a: Audit, v: Verdict) -> None:
    """What stock does on load, said only where it was established for this optimizer flavour
    and format: with torch Adam the step-less formats fail on stock (its own checkpoints too);
    with an optimizer the checkpoint does not name, a claim that it loads is left out."""
    if not v.stock or v.stock.startswith(FAILS):
        return
    flavour = optimizer_flavour(a.view)
    stepless = sorted(set(a.formats) & set(STEPLESS))
    v.evidence.setdefault("optimizer", flavour)
    if flavour == "torch Adam" and stepless:
        v.stock = (
            f"fails to load it with torch Adam (KeyError: 'step': {_names(stepless)} saves no "
            "per-param step; so do its own checkpoints of this format)"
        )
    elif flavour is None:
        v.stock = ""


# --- the command ----------------------------------------------------------------------------


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


def audit(path: Path) -> Report:
    """Audit the checkpoint at `path` (read-only); UserError for bad input."""
    files = Files()
    try:
        view = read_view(path, files)
        a = Audit(view)
        verdicts = [
            check_loss_scale(view),
            check_param_index(a),
            check_reshard_padding(a),
            check_param_groups(a),
            check_step(a),
        ]
        for v in verdicts:
            _established(a, v)
        return Report(view.path, view.kind, view.iteration, view.note, verdicts)
    except MALFORMED as exc:  # met past the reader's checks: still one line
        why = f"{type(exc).__name__}: {str(exc)[:200]}"
        raise BadCheckpoint(f"{path}: not a checkpoint Megatron writes ({why})") from None
    finally:
        files.close()
