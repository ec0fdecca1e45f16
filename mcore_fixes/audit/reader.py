"""What a Megatron checkpoint holds, read lazily: its View (model weights, optimizer state,
saved objects) and how a path leads to it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
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
)

TRACKER = "latest_checkpointed_iteration.txt"

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
