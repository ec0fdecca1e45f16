"""Read Megatron checkpoints on CPU, tensor by tensor, without running code from them.

Two containers hold everything Megatron writes:
- a `torch.save` archive (a zip: `data.pkl` plus one stored record per storage), as a file
  (`common.pt`, `model_optim_rng.pt`, `distrib_optim.pt`) or embedded in a `.distcp` file at an
  offset (each tensor chunk and each pickled object of a `torch_dist` checkpoint);
- a `torch_dist` directory: `.metadata` (torch.distributed.checkpoint's pickled `Metadata`) says
  which byte range of which `.distcp` file holds each chunk.

Pickles are read by an unpickler that builds only data: tensors become `LazyTensor`s (where
their bytes are, never read until asked for, in windows, as numpy arrays), torch dtypes their
names, sizes tuples, and any other class an `Opaque` record of its name and state
(torch.distributed.checkpoint's metadata classes, argparse.Namespace, enums, numpy arrays).
Nothing from the checkpoint is imported or called, torch included: reading needs numpy only.
Files are opened read-only.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UserError

ZIP_MAGIC = b"PK\x03\x04"


class BadCheckpoint(UserError):
    """A file of the checkpoint is missing, truncated or not what Megatron writes."""


class TorchDType(str):
    """A torch dtype, by name ("float32", "bfloat16", ...)."""


# How each dtype's elements are read: 16-bit floats as their bits (numpy has no bfloat16).
NUMPY = {
    "float32": np.float32,
    "float64": np.float64,
    "bfloat16": np.uint16,
    "float16": np.uint16,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
}
FLOATS = ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


@dataclass(eq=False)
class Opaque:
    """An object of a class the reader does not build: its name, constructor args and state."""

    name: str
    args: tuple = ()
    state: Any = None

    def __setstate__(self, state: Any) -> None:  # pickle BUILD
        self.state = state

    def get(self, attr: str, default: Any = None) -> Any:
        """An attribute of the object as pickled (argparse.Namespace, dataclasses)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots)
        return state.get(attr, default) if isinstance(state, dict) else default


def _opaque_class(name: str) -> type:
    class _Stub:
        def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:  # REDUCE and NEWOBJ
            return Opaque(name, args)

    _Stub.__name__ = name
    return _Stub


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:  # copyreg._reconstructor
    return cls() if isinstance(cls, type) else Opaque(str(cls))


class _Shaped:
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class StorageRef:
    archive: Archive
    key: str
    dtype: TorchDType
    numel: int


@dataclass
class LazyTensor(_Shaped):
    """A tensor of an archive: where its elements are; `read` fetches a flat range of them."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> TorchDType:
        return self.storage.dtype

    def _contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements [start, stop) of the tensor, flattened in row-major order (see NUMPY)."""
        stop = self.numel if stop is None else stop
        archive = self.storage.archive
        if self._contiguous():
            return archive.read_elements(self.storage, self.offset + start, stop - start)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        whole = archive.read_elements(self.storage, self.offset, span)
        strides = [st * whole.itemsize for st in self.stride]
        view = np.lib.stride_tricks.as_strided(whole, self.shape, strides)
        return view.reshape(-1)[start:stop].copy()

    def item(self) -> float:
        return to_float32(self.read(0, 1), self.dtype)[0].item()


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values read as NUMPY[dtype] (16-bit floats as bits), as float32."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return values.view(np.float16).astype(np.float32)
    return values.astype(np.float32, copy=False)


def _rebuild_tensor(storage: StorageRef, offset: int, size: Any, stride: Any, *rest: Any) -> Any:
    return LazyTensor(storage, int(offset), tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: tuple, state: Any) -> Any:
    return func(*args)


_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "short": "int16",
    "int": "int32",
    "long": "int64",
}
_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "ByteStorage": "uint8",
    "CharStorage": "int8",
    "ShortStorage": "int16",
    "IntStorage": "int32",
    "LongStorage": "int64",
    "BoolStorage": "bool",
    "UntypedStorage": "uint8",
}
_SAFE_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range", "bytes"}


class _Unpickler(pickle.Unpickler):
    """Builds data only; see the module docstring."""

    def __init__(self, data: bytes, archive: Archive | None):
        super().__init__(io.BytesIO(data))
        self.archive = archive

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name.startswith("_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch._utils" and name.startswith("_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type_v2
        if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
            return TorchDType(_STORAGE_DTYPES[name])
        if module == "torch" and (name in NUMPY or name in _ALIASES):
            return TorchDType(_ALIASES.get(name, name))
        if module == "torch" and name == "Size":
            return tuple
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(__import__("builtins"), name)
        if module == "copyreg" and name == "_reconstructor":
            return _reconstructor
        return _opaque_class(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and len(pid) >= 5):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if self.archive is None:
            raise pickle.UnpicklingError("a tensor outside a torch.save archive")
        _, dtype, key, _location, numel = pid[:5]
        if not isinstance(dtype, TorchDType):
            raise pickle.UnpicklingError(f"unknown storage type {dtype!r}")
        return StorageRef(self.archive, str(key), dtype, int(numel))


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a file, as a seekable read-only stream."""

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, n, self.base + self.pos)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


class Files:
    """Read-only file descriptors of one checkpoint, opened once each."""

    def __init__(self) -> None:
        self._fds: dict[Path, tuple[int, int]] = {}

    def open(self, path: Path) -> tuple[int, int]:
        """(fd, size) of `path`."""
        if path not in self._fds:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise BadCheckpoint(f"{path} is missing") from None
            except OSError as exc:
                raise BadCheckpoint(f"cannot read {path} ({exc.strerror})") from None
            self._fds[path] = (fd, os.fstat(fd).st_size)
        return self._fds[path]

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class Archive:
    """A torch.save archive in bytes [offset, offset + length) of `path`."""

    files: Files
    path: Path
    offset: int = 0
    length: int | None = None
    _records: dict[str, int] = field(default_factory=dict, repr=False)
    _prefix: str = ""

    def _where(self) -> str:
        return f"{self.path}" + (f" (bytes {self.offset}..)" if self.offset else "")

    def load(self) -> Any:
        """The pickled object, tensors as LazyTensors."""
        fd, size = self.files.open(self.path)
        length = size - self.offset if self.length is None else self.length
        if self.offset + length > size:
            raise BadCheckpoint(f"{self._where()} is truncated")
        try:
            with zipfile.ZipFile(_Window(fd, self.offset, length)) as zf:
                names = [i for i in zf.infolist() if i.filename.endswith("data.pkl")]
                if not names:
                    raise BadCheckpoint(f"{self._where()}: not a torch.save archive")
                self._prefix = names[0].filename[: -len("data.pkl")]
                for info in zf.infolist():
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise BadCheckpoint(f"{self._where()}: compressed record {info.filename}")
                    self._records[info.filename] = info.header_offset
                order = zf.read(self._prefix + "byteorder") if self._has("byteorder") else b"little"
                if order.strip() != b"little":
                    raise BadCheckpoint(f"{self._where()}: big-endian archive")
                data = zf.read(names[0])
        except (zipfile.BadZipFile, EOFError, KeyError, OSError, struct.error) as exc:
            raise BadCheckpoint(
                f"{self._where()}: not a readable torch.save archive ({exc})"
            ) from None
        return unpickle(data, self)

    def _has(self, name: str) -> bool:
        return self._prefix + name in self._records

    def read_elements(self, storage: StorageRef, start: int, count: int) -> np.ndarray:
        """`count` elements of `storage` from element `start` (a copy, at most a window)."""
        if start < 0 or start + count > storage.numel:
            raise BadCheckpoint(f"{self._where()}: a tensor runs past its storage")
        fd, size = self.files.open(self.path)
        name = self._prefix + "data/" + storage.key
        if name not in self._records:
            raise BadCheckpoint(f"{self._where()}: record {name} is missing")
        header = self.offset + self._records[name]
        local = os.pread(fd, 30, header)
        if len(local) < 30 or local[:4] != ZIP_MAGIC:
            raise BadCheckpoint(f"{self._where()}: record {name} is damaged")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        dtype = np.dtype(NUMPY.get(storage.dtype, np.uint8))
        itemsize = dtype.itemsize
        begin = header + 30 + name_len + extra_len + start * itemsize
        nbytes = count * itemsize
        if begin + nbytes > size:
            raise BadCheckpoint(f"{self._where()} is truncated")
        data = os.pread(fd, nbytes, begin)
        if len(data) != nbytes:
            raise BadCheckpoint(f"{self._where()} is truncated")
        return np.frombuffer(data, dtype=dtype)


def unpickle(data: bytes, archive: Archive | None = None, where: str = "pickle") -> Any:
    try:
        return _Unpickler(data, archive).load()
    except BadCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is one line
        where = archive._where() if archive is not None else where
        raise BadCheckpoint(f"{where}: cannot unpickle ({type(exc).__name__}: {exc})") from None


def load_file(files: Files, path: Path) -> Any:
    """The object a torch.save file holds (tensors lazy)."""
    return Archive(files, path).load()


@dataclass
class RawTensor(_Shaped):
    """A chunk written as raw bytes (torch.distributed.checkpoint's non-torch.save format)."""

    files: Files
    path: Path
    offset: int
    dtype: TorchDType
    shape: tuple[int, ...]

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.numel if stop is None else stop
        fd, _ = self.files.open(self.path)
        dtype = np.dtype(NUMPY.get(self.dtype, np.uint8))
        begin, nbytes = self.offset + start * dtype.itemsize, (stop - start) * dtype.itemsize
        data = os.pread(fd, nbytes, begin)
        if len(data) != nbytes:
            raise BadCheckpoint(f"{self.path} is truncated")
        return np.frombuffer(data, dtype=dtype)


@dataclass
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: Path
    offset: int
    length: int


@dataclass
class DistItem:
    """One key of a torch_dist checkpoint: a tensor (dtype, global shape, chunks) or an object."""

    key: str
    dtype: TorchDType | None  # None: an object (bytes)
    shape: tuple[int, ...]
    chunks: list[Chunk]


class DistCheckpoint:
    """A torch_dist directory: its .metadata, its items, and reads of them."""

    def __init__(self, files: Files, root: Path):
        self.files, self.root = files, root
        meta_path = root / ".metadata"
        try:
            data = meta_path.read_bytes()
        except OSError as exc:
            raise BadCheckpoint(f"{meta_path}: cannot read ({exc.strerror})") from None
        meta = unpickle(data, None, where=str(meta_path))
        state = _field(meta, "state_dict_metadata")
        storage = _field(meta, "storage_data")
        if not isinstance(state, dict) or not isinstance(storage, dict):
            raise BadCheckpoint(f"{meta_path}: not torch.distributed.checkpoint metadata")
        where: dict[str, list[tuple[tuple[int, ...] | None, Any]]] = {}
        for index, info in storage.items():
            offset = _field(index, "offset")
            key = (None if offset is None else tuple(offset), info)
            where.setdefault(_field(index, "fqn"), []).append(key)
        self.items: dict[str, DistItem] = {}
        for key, md in state.items():
            entries = where.get(key, [])
            if not entries:
                raise BadCheckpoint(f"{meta_path}: no storage for {key}")
            chunks_md = _field(md, "chunks")
            if chunks_md is None:  # an object (BytesStorageMetadata)
                self.items[key] = DistItem(key, None, (), [self._chunk((), (), entries[0][1])])
                continue
            by_offset = dict(entries)
            chunks = []
            for c in chunks_md:
                offsets, sizes = tuple(_field(c, "offsets")), tuple(_field(c, "sizes"))
                info = by_offset.get(offsets)
                if info is None:
                    raise BadCheckpoint(f"{meta_path}: chunk {offsets} of {key} lost")
                chunks.append(self._chunk(offsets, sizes, info))
            props = _field(md, "properties")
            # TensorProperties pickles its state as a tuple (dtype first) or, older, a dict
            pstate = props.state if isinstance(props, Opaque) else None
            dtype = pstate[0] if isinstance(pstate, tuple) and pstate else _field(props, "dtype")
            if not isinstance(dtype, TorchDType):
                raise BadCheckpoint(f"{meta_path}: no dtype for {key}")
            self.items[key] = DistItem(key, dtype, tuple(_field(md, "size")), chunks)

    def _chunk(self, offsets: tuple, sizes: tuple, info: Any) -> Chunk:
        if _field(info, "transform_descriptors"):
            raise BadCheckpoint(f"{self.root}: stored with transforms the audit cannot read")
        path = self.root / str(_field(info, "relative_path"))
        offset, length = int(_field(info, "offset")), int(_field(info, "length"))
        _, size = self.files.open(path)
        if offset + length > size:
            raise BadCheckpoint(
                f"{path} is truncated ({size} bytes, an item ends at {offset + length})"
            )
        return Chunk(offsets, sizes, path, offset, length)

    def tensor(self, item: DistItem, chunk: Chunk) -> LazyTensor | RawTensor:
        """The tensor of one chunk of `item`."""
        fd, _ = self.files.open(chunk.path)
        if os.pread(fd, 4, chunk.offset) == ZIP_MAGIC:
            value = Archive(self.files, chunk.path, chunk.offset, chunk.length).load()
            if not isinstance(value, LazyTensor):
                raise BadCheckpoint(f"{item.key}: the chunk at {chunk.offsets} is not a tensor")
            return value
        assert item.dtype is not None
        return RawTensor(self.files, chunk.path, chunk.offset, item.dtype, chunk.sizes)

    def object(self, item: DistItem) -> Any:
        """The object of a bytes item (a ShardedObject, the common state)."""
        chunk = item.chunks[0]
        return Archive(self.files, chunk.path, chunk.offset, chunk.length).load()


def _field(obj: Any, name: str) -> Any:
    """A field of a pickled object (an Opaque's state, or a dict)."""
    if isinstance(obj, Opaque):
        return obj.get(name)
    return obj.get(name) if isinstance(obj, dict) else None


def walk(obj: Any, path: tuple = ()) -> Any:
    """(path, value) of every dict, list and tuple element nested in `obj`, depth first."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk(v, (*path, i))
    elif isinstance(obj, Opaque) and isinstance(obj.state, dict):
        for k, v in obj.state.items():
            yield from walk(v, (*path, k))
