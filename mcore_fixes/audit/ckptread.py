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

Every byte is taken as hostile (`audit` reads checkpoints of unknown origin):
- files: only regular files inside the checkpoint's directory are opened (no FIFO, device or
  path leading outside it), read-only and non-blocking; pickles are read whole only up to
  PICKLE_MAX bytes;
- pickles: nothing is built whose size the file gives (`bytearray(n)`, `range`), and the
  objects are checked once, as built: nested at most MAX_DEPTH deep; `walk` visits each
  container once (a structure holding itself ends). A pickle that shares objects, or a large
  one, is unpickled in a child process first (`unpickle`): what would crash or never end
  while the C unpickler hashes dict keys ends there;
- tensors: dtypes, sizes, strides and offsets are checked against their storage, and each
  storage against the bytes its record holds, before any element is read; reads index with
  checked positions (no strided view of raw memory);
- torch_dist metadata: offsets and lengths are non-negative integers inside their file, and
  every `relative_path` names a file inside the checkpoint.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
import select
import signal
import stat
import struct
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError

ZIP_MAGIC = b"PK\x03\x04"
PICKLE_MAX = 512 << 20  # bytes of one pickle (`.metadata`, a `data.pkl`)
MAX_DEPTH = 100  # nesting of a pickled structure (Megatron's state dicts nest about 10 deep)
MAX_DIMS = 64
TREE_MAX = 16 << 10  # bytes of a pickle unpickled at once where it shares no object
UNPICKLE_SECONDS = 30  # for any other pickle, in a child, plus one per MB
_SHARING = {"GET", "BINGET", "LONG_BINGET", "DUP"}
MAX_NAME = 4096  # characters of an item's name (Megatron's are a few hundred at most)
_HUGE = 1 << 62  # no size, offset or stride of a real tensor or file comes near it


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
            first = state[0] if isinstance(state[0], dict) else {}
            state = {**first, **state[1]}  # (dict, slots)
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
        _check_range(start, stop, self.numel, self.storage.archive._where())
        archive = self.storage.archive
        if self._contiguous():
            return archive.read_elements(self.storage, self.offset + start, stop - start)
        # Each element's position in the storage (checked at unpickling: inside it), then the
        # elements they span, indexed: numpy checks every index, nothing reads past a buffer.
        where = np.zeros(stop - start, np.int64)
        dims = np.unravel_index(np.arange(start, stop, dtype=np.int64), self.shape)
        for index, stride in zip(dims, self.stride, strict=True):
            where += index.astype(np.int64) * stride
        if where.size == 0:
            return archive.read_elements(self.storage, self.offset, 0)
        low = int(where.min())
        span = archive.read_elements(self.storage, self.offset + low, int(where.max()) - low + 1)
        return span[where - low]

    def item(self) -> float:
        return to_float32(self.read(0, 1), self.dtype)[0].item()


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values read as NUMPY[dtype] (16-bit floats as bits), as float32."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return values.view(np.float16).astype(np.float32)
    return values.astype(np.float32, copy=False)


def _check_range(start: int, stop: int, numel: int, where: str) -> None:
    if not 0 <= start <= stop <= numel:
        raise BadCheckpoint(f"{where}: elements [{start}, {stop}) of a tensor of {numel} asked")


def _count(value: Any) -> int | None:
    """`value` if it is a plausible size, offset or stride (a non-negative int), else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _HUGE
    return value if ok else None


def _counts(value: Any) -> tuple[int, ...] | None:
    """`value` as a tuple of plausible counts (a shape, strides, offsets), else None."""
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        return None
    counts = tuple(_count(v) for v in value)
    return None if None in counts else counts  # type: ignore[return-value]


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
    """A LazyTensor, once its view is checked to lie inside its storage (torch's own strides
    are non-negative; a tensor views at most its storage's elements)."""
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("a tensor without a storage")
    where = storage.archive._where()
    shape, strides, start = _counts(size), _counts(stride), _count(offset)
    if shape is None or strides is None or start is None or len(shape) != len(strides):
        raise BadCheckpoint(
            f"{where}: a tensor whose size, stride or offset is not a list of non-negative "
            "integers of one length"
        )
    tensor = LazyTensor(storage, start, shape, strides)
    last = start + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    if tensor.numel and (last >= storage.numel or tensor.numel > storage.numel):
        raise BadCheckpoint(
            f"{where}: a tensor of size {list(shape)}, stride {list(strides)} at offset {start} "
            f"runs outside its storage of {storage.numel} elements"
        )
    return tensor


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
# Built from what the pickle holds (nothing sized by a number in the file: bytes and bytearray
# of an int, range, are refused)
_SAFE_BUILTINS = {"set", "frozenset", "slice", "complex"}


def _bytes_of(kind: type) -> Any:
    def build(*args: Any) -> Any:
        if args and not isinstance(args[0], (bytes, bytearray, list, tuple, str)):
            raise pickle.UnpicklingError(f"{kind.__name__} of a size the file gives")
        return kind(*args)

    return build


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
        if module == "builtins" and name in ("bytes", "bytearray"):
            return _bytes_of(bytes if name == "bytes" else bytearray)
        if module == "copyreg" and name == "_reconstructor":
            return _reconstructor
        return _opaque_class(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and len(pid) >= 5):
            raise pickle.UnpicklingError("an unknown persistent id")
        if self.archive is None:
            raise pickle.UnpicklingError("a tensor outside a torch.save archive")
        _, dtype, key, _location, numel = pid[:5]
        if not isinstance(dtype, TorchDType):
            raise pickle.UnpicklingError("unknown storage type")
        if not isinstance(key, str) or _count(numel) is None:
            raise pickle.UnpicklingError("a storage without a key or a size")
        return self.archive.storage(key, dtype, numel)


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
    """Read-only file descriptors of one checkpoint, opened once each: regular files inside
    `root` (once set) only."""

    def __init__(self, root: Path | None = None) -> None:
        self._fds: dict[Path, tuple[int, int]] = {}
        self.root = root

    def open(self, path: Path) -> tuple[int, int]:
        """(fd, size) of `path`."""
        if path not in self._fds:
            real = Path(os.path.realpath(path))
            if self.root is not None and not real.is_relative_to(os.path.realpath(self.root)):
                raise BadCheckpoint(f"{path} leads outside the checkpoint {self.root} (to {real})")
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
            try:  # non-blocking: a FIFO's open returns at once (and is refused below)
                fd = os.open(real, flags)
            except FileNotFoundError:
                raise BadCheckpoint(f"{path} is missing") from None
            except OSError as exc:
                raise BadCheckpoint(f"cannot read {path} ({exc.strerror})") from None
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                os.close(fd)
                raise BadCheckpoint(f"{path} is not a regular file ({_kind(mode)})")
            self._fds[path] = (fd, os.fstat(fd).st_size)
        return self._fds[path]

    def read(self, path: Path, limit: int = PICKLE_MAX) -> bytes:
        """The bytes of `path`, a regular file of at most `limit` bytes."""
        fd, size = self.open(path)
        if size > limit:
            raise BadCheckpoint(f"{path} is {size} bytes, more than the {limit} it may have")
        data = os.pread(fd, size, 0)
        if len(data) != size:
            raise BadCheckpoint(f"{path} is truncated")
        return data

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    kinds += [(stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    return next((name for test, name in kinds if test(mode)), "not a file")


@dataclass
class Archive:
    """A torch.save archive in bytes [offset, offset + length) of `path`."""

    files: Files
    path: Path
    offset: int = 0
    length: int | None = None
    _records: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)  # header, size
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
                    self._records[info.filename] = (info.header_offset, info.file_size)
                if self._has("byteorder") and self._records[self._prefix + "byteorder"][1] > 16:
                    raise BadCheckpoint(f"{self._where()}: its byteorder record is not one word")
                order = zf.read(self._prefix + "byteorder") if self._has("byteorder") else b"little"
                if order.strip() != b"little":
                    raise BadCheckpoint(f"{self._where()}: big-endian archive")
                size = max(names[0].file_size, names[0].compress_size)
                if size > PICKLE_MAX:
                    raise BadCheckpoint(
                        f"{self._where()}: its data.pkl is {size} bytes, more than the "
                        f"{PICKLE_MAX} it may have"
                    )
                data = zf.read(names[0])
        except (zipfile.BadZipFile, EOFError, KeyError, OSError, struct.error) as exc:
            raise BadCheckpoint(
                f"{self._where()}: not a readable torch.save archive ({exc})"
            ) from None
        return unpickle(data, self)

    def _has(self, name: str) -> bool:
        return self._prefix + name in self._records

    def storage(self, key: str, dtype: TorchDType, numel: int) -> StorageRef:
        """A storage of the archive, once its record is known to hold its `numel` elements."""
        record = self._records.get(self._prefix + "data/" + key)
        if record is None:
            raise BadCheckpoint(f"{self._where()}: record data/{key} is missing")
        itemsize = np.dtype(NUMPY.get(dtype, np.uint8)).itemsize
        if numel * itemsize > record[1]:
            raise BadCheckpoint(
                f"{self._where()}: storage {key} of {numel} {dtype} elements is larger than its "
                f"record ({record[1]} bytes)"
            )
        return StorageRef(self, key, dtype, numel)

    def read_elements(self, storage: StorageRef, start: int, count: int) -> np.ndarray:
        """`count` elements of `storage` from element `start` (a copy, at most a window)."""
        if start < 0 or count < 0 or start + count > storage.numel:
            raise BadCheckpoint(f"{self._where()}: a tensor runs past its storage")
        fd, size = self.files.open(self.path)
        name = self._prefix + "data/" + storage.key
        if name not in self._records:
            raise BadCheckpoint(f"{self._where()}: record {name} is missing")
        header = self.offset + self._records[name][0]
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
    """The object `data` pickles (see the module docstring). A pickle that shares objects
    (memo, DUP) or is larger than TREE_MAX is first unpickled in a child process: the C
    unpickler hashes dict keys as it builds them, which recurses with no limit (a key nested a
    million deep crashes the process) and can take exponential time (a tuple of itself twice,
    forty times over); that happens in the child, killed after UNPICKLE_SECONDS (and one more
    per MB)."""
    where = archive._where() if archive is not None else where
    if not _plain_tree(data):
        _isolated(lambda: _unpickle(data, archive, where), len(data) >> 20, where)
    return _unpickle(data, archive, where)


def _unpickle(data: bytes, archive: Archive | None, where: str) -> Any:
    try:
        value = _Unpickler(data, archive).load()
    except BadCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is one line
        raise BadCheckpoint(f"{where}: cannot unpickle ({type(exc).__name__}: {exc})") from None
    if _depth(value) > MAX_DEPTH:
        raise BadCheckpoint(f"{where}: a structure nested more than {MAX_DEPTH} levels deep")
    return value


def _plain_tree(data: bytes) -> bool:
    """Whether `data` is a small pickle that shares no object: building it is bounded by its
    size, in time and in recursion (torch.save's archive of one tensor is one)."""
    if len(data) > TREE_MAX:
        return False
    try:
        return not any(op.name in _SHARING for op, _, _ in pickletools.genops(data))
    except Exception:  # noqa: BLE001 - malformed: the child says how
        return False


def _isolated(work: Callable[[], Any], megabytes: int, where: str) -> None:
    """Run `work` in a child process first; BadCheckpoint if it fails there, crashes, or runs
    longer than UNPICKLE_SECONDS + `megabytes` seconds."""
    seconds = UNPICKLE_SECONDS + megabytes
    read, write = os.pipe()
    with warnings.catch_warnings():  # numpy's threads: the child only unpickles
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        status = 0
        try:
            work()
        except BadCheckpoint as exc:
            os.write(write, str(exc).encode("utf-8", "surrogateescape")[:4096])
            status = 3
        except BaseException:  # noqa: BLE001 - anything else: the parent says it
            status = 4
        os._exit(status)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], seconds)
        message = os.read(read, 4096).decode("utf-8", "surrogateescape") if ready else ""
    finally:
        os.close(read)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if not ready:
        raise BadCheckpoint(f"{where}: unpickling it takes more than {seconds} s (refused)")
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        raise BadCheckpoint(f"{where}: cannot unpickle: it crashes the reader ({sig})")
    if os.WEXITSTATUS(status) != 0:
        raise BadCheckpoint(message or f"{where}: cannot unpickle (the reader failed)")


def _children(obj: Any) -> Any:
    """What a container holds (dict keys too); () for anything else."""
    if isinstance(obj, dict):
        return (*obj.keys(), *obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    return (obj.args, obj.state) if isinstance(obj, Opaque) else ()


_CONTAINERS = (dict, list, tuple, set, frozenset, Opaque)


def _depth(root: Any) -> int:
    """How deep containers nest in `root`, level by level (each container once: cycles end),
    counted up to MAX_DEPTH + 1."""
    depth, seen, level = 0, set(), [root] if isinstance(root, _CONTAINERS) else []
    while level and depth <= MAX_DEPTH:
        depth += 1
        below = []
        for obj in level:
            if id(obj) not in seen:
                seen.add(id(obj))
                below += [c for c in _children(obj) if isinstance(c, _CONTAINERS)]
        level = below
    return depth


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
        _check_range(start, stop, self.numel, str(self.path))
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
        self.meta_path = meta_path = root / ".metadata"
        meta = unpickle(files.read(meta_path), None, where=str(meta_path))
        state = _field(meta, "state_dict_metadata")
        storage = _field(meta, "storage_data")
        if not isinstance(state, dict) or not isinstance(storage, dict):
            raise BadCheckpoint(f"{meta_path}: not torch.distributed.checkpoint metadata")
        where: dict[str, list[tuple[tuple[int, ...] | None, Any]]] = {}
        for index, info in storage.items():
            offset = _field(index, "offset")
            key = (None if offset is None else self._counts(offset, "a chunk offset"), info)
            where.setdefault(_field(index, "fqn"), []).append(key)
        self.items: dict[str, DistItem] = {}
        for key, md in state.items():
            if not isinstance(key, str) or len(key) > MAX_NAME:
                raise BadCheckpoint(
                    f"{meta_path}: an item whose name is not a string of at most {MAX_NAME} "
                    "characters"
                )
            entries = where.get(key, [])
            if not entries:
                raise BadCheckpoint(f"{meta_path}: no storage for {key}")
            chunks_md = _field(md, "chunks")
            if chunks_md is None:  # an object (BytesStorageMetadata)
                self.items[key] = DistItem(key, None, (), [self._chunk((), (), entries[0][1])])
                continue
            if not isinstance(chunks_md, (list, tuple)):
                raise BadCheckpoint(f"{meta_path}: the chunks of {key} are not a list")
            by_offset = dict(entries)
            chunks = []
            for c in chunks_md:
                offsets = self._counts(_field(c, "offsets"), f"a chunk offset of {key}")
                sizes = self._counts(_field(c, "sizes"), f"a chunk size of {key}")
                info = by_offset.get(offsets)
                if info is None:
                    raise BadCheckpoint(f"{meta_path}: chunk {list(offsets)} of {key} lost")
                chunks.append(self._chunk(offsets, sizes, info))
            props = _field(md, "properties")
            # TensorProperties pickles its state as a tuple (dtype first) or, older, a dict
            pstate = props.state if isinstance(props, Opaque) else None
            dtype = pstate[0] if isinstance(pstate, tuple) and pstate else _field(props, "dtype")
            if not isinstance(dtype, TorchDType):
                raise BadCheckpoint(f"{meta_path}: no dtype for {key}")
            shape = self._counts(_field(md, "size"), f"the size of {key}")
            self.items[key] = DistItem(key, dtype, shape, chunks)

    def _counts(self, value: Any, what: str) -> tuple[int, ...]:
        counts = _counts(value)
        if counts is None:
            raise BadCheckpoint(f"{self.meta_path}: {what} is not a list of non-negative integers")
        return counts

    def _chunk(self, offsets: tuple, sizes: tuple, info: Any) -> Chunk:
        if _field(info, "transform_descriptors"):
            raise BadCheckpoint(f"{self.root}: stored with transforms the audit cannot read")
        name = _field(info, "relative_path")
        parts = name.split("/") if isinstance(name, str) else []
        if not name or "\0" in name or name.startswith("/") or {"..", ""} & set(parts):
            raise BadCheckpoint(
                f"{self.meta_path}: a chunk's file ({_short(name)}) is not a path inside the "
                "checkpoint"
            )
        path = self.root / name
        offset, length = _count(_field(info, "offset")), _count(_field(info, "length"))
        if offset is None or length is None:
            raise BadCheckpoint(
                f"{self.meta_path}: the offset or length of a chunk in {name} is not a "
                "non-negative integer"
            )
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
        raw = RawTensor(self.files, chunk.path, chunk.offset, item.dtype, chunk.sizes)
        if raw.numel * np.dtype(NUMPY.get(item.dtype, np.uint8)).itemsize > chunk.length:
            raise BadCheckpoint(
                f"{chunk.path}: the chunk of {item.key} at {list(chunk.offsets)} holds fewer "
                f"bytes ({chunk.length}) than its size {list(chunk.sizes)} needs"
            )
        return raw

    def object(self, item: DistItem) -> Any:
        """The object of a bytes item (a ShardedObject, the common state)."""
        chunk = item.chunks[0]
        return Archive(self.files, chunk.path, chunk.offset, chunk.length).load()


def _short(value: Any) -> str:
    """A value of the file, for a message: a string (cut short) or its type."""
    return repr(value[:80]) if isinstance(value, str) else type(value).__name__


def _field(obj: Any, name: str) -> Any:
    """A field of a pickled object (an Opaque's state, or a dict)."""
    if isinstance(obj, Opaque):
        return obj.get(name)
    return obj.get(name) if isinstance(obj, dict) else None


def walk(obj: Any, path: tuple = ()) -> Any:
    """(path, value) of every dict, list and tuple element nested in `obj`, depth first; a
    container met again (shared, or holding itself) is yielded but not entered again."""
    seen: set[int] = set()
    stack = [(path, obj)]
    while stack:
        path, obj = stack.pop()
        yield path, obj
        if isinstance(obj, Opaque):
            obj = obj.state if isinstance(obj.state, dict) else None
        if not isinstance(obj, (dict, list, tuple)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        stack += reversed([((*path, k), v) for k, v in items])
