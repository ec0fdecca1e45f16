"""Hand-made checkpoint files for the hostile-input tests: pickles of any shape (torch's globals
named, never imported), torch.save archives and torch_dist `.metadata` around them.

    dumps(obj)  # protocol-2 pickle; Global/Reduce/Build/PersId/Raw nodes emit what they say
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, eq=False)
class Global:
    module: str
    name: str


@dataclass(frozen=True, eq=False)
class Reduce:
    func: Any
    args: tuple


@dataclass(frozen=True, eq=False)
class Build:
    obj: Any
    state: Any


@dataclass(frozen=True, eq=False)
class PersId:
    pid: Any


@dataclass(frozen=True, eq=False)
class Raw:
    """Opcodes as they are (e.g. a structure that holds itself)."""

    ops: bytes


def _emit(obj: Any) -> bytes:
    if isinstance(obj, Global):
        return f"c{obj.module}\n{obj.name}\n".encode()
    if isinstance(obj, Reduce):
        return _emit(obj.func) + _emit(obj.args) + b"R"
    if isinstance(obj, Build):
        return _emit(obj.obj) + _emit(obj.state) + b"b"
    if isinstance(obj, PersId):
        return _emit(obj.pid) + b"Q"
    if isinstance(obj, Raw):
        return obj.ops
    if isinstance(obj, tuple):
        return b"(" + b"".join(map(_emit, obj)) + b"t"
    if isinstance(obj, list):
        return b"(" + b"".join(map(_emit, obj)) + b"l"
    if isinstance(obj, dict):
        return b"(" + b"".join(_emit(k) + _emit(v) for k, v in obj.items()) + b"d"
    return pickle.dumps(obj, protocol=2)[2:-1]  # None, bool, int, float, str


def dumps(obj: Any) -> bytes:
    return b"\x80\x02" + _emit(obj) + b"."


def obj(cls: str, state: dict) -> Build:
    """An instance of class `module.Name` with `state` (as pickle rebuilds dataclasses)."""
    module, _, name = cls.rpartition(".")
    return Build(Reduce(Global(module, name), ()), state)


def tensor(key: str, numel: int, size: tuple, stride: tuple, offset: int = 0) -> Reduce:
    """A float32 tensor on storage `key` of `numel` elements, as torch.save pickles it."""
    storage = PersId(("storage", Global("torch", "FloatStorage"), key, "cpu", numel))
    ordered = Reduce(Global("collections", "OrderedDict"), ())
    args = (storage, offset, size, stride, False, ordered)
    return Reduce(Global("torch._utils", "_rebuild_tensor_v2"), args)


def torch_save(path: Path, data_pkl: bytes, storages: dict[str, bytes] | None = None) -> Path:
    """A torch.save archive: `data_pkl` and one stored record per storage."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/byteorder", "little")
        for key, data in (storages or {}).items():
            zf.writestr(f"archive/data/{key}", data)
    return path


def metadata(items: dict[str, dict]) -> bytes:
    """torch.distributed.checkpoint `.metadata` of object items: fqn -> _StorageInfo state."""
    mod = "torch.distributed.checkpoint.metadata"
    state = {fqn: obj(f"{mod}.BytesStorageMetadata", {}) for fqn in items}
    storage = {
        obj(f"{mod}.MetadataIndex", {"fqn": fqn, "offset": None, "index": 0}): obj(
            "torch.distributed.checkpoint.filesystem._StorageInfo",
            {"transform_descriptors": None, **info},
        )
        for fqn, info in items.items()
    }
    return dumps(obj(f"{mod}.Metadata", {"state_dict_metadata": state, "storage_data": storage}))
