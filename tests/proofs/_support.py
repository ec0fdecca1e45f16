"""What the CPU proofs share: a gloo world forked from the test process, and the CUDA shim.

The proofs run against a materialized MCore tree (on PYTHONPATH) on a host without CUDA.
Ranks fork from the test process, which has imported torch and megatron.core once already, so
a world of 2-3 ranks costs milliseconds rather than a fresh interpreter each.

MCore places some bookkeeping on CUDA unconditionally (``device='cuda'``, ``.cuda()``,
``param.type() == 'torch.cuda.HalfTensor'``). ``CudaOnCpu`` lets that unmodified code run with
CPU tensors standing in for CUDA tensors: it changes placement and the reported type name,
nothing else. It is disclosed in every proof that uses it; the GPU tier runs without it.
"""

from __future__ import annotations

import copy
import gc
import inspect
import itertools
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class CudaOnCpu(TorchFunctionMode):
    """``device='cuda'`` -> CPU, ``.cuda()`` -> no-op, ``Tensor.type()`` -> CUDA type name.

    While active, ``torch.cuda.current_device()`` returns 0 (e.g. ``DynamicGradScaler.
    load_state_dict`` moves the scale to it), which then maps to the CPU like any CUDA device.
    """

    def __enter__(self):
        self._current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.current_device = self._current_device
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        # An int device is a CUDA ordinal (torch.device(0) needs an accelerator to resolve).
        if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            if isinstance(result, str) and not result.startswith("torch.cuda."):
                result = result.replace("torch.", "torch.cuda.", 1)
        return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CountAllReduce:
    """Counts ``torch.distributed.all_reduce`` calls, delegating to the real one."""

    def __enter__(self) -> CountAllReduce:
        self.calls = 0
        self._all_reduce = dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            return self._all_reduce(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._all_reduce


class CountHostSyncs(TorchFunctionMode):
    """Records the calls that block the host on a CUDA tensor, delegating to the real ones.

    Device-to-host reads (``item``, ``tolist``, ``bool()``, ``float()``, ``int()``, ``cpu``)
    and blocking host-to-device copies (``torch.tensor``/``torch.as_tensor`` with a CUDA
    ``device``, ``.cuda()``, ``.to()`` a CUDA device). Enter it inside ``CudaOnCpu`` (it must see
    ``device='cuda'`` before the shim maps it): every tensor then stands for a CUDA one, so the
    count bounds the syncs a GPU would make (a read of a host tensor counts too).
    """

    READS = {
        torch.Tensor.item: "item",
        torch.Tensor.tolist: "tolist",
        torch.Tensor.__bool__: "bool",
        torch.Tensor.__float__: "float",
        torch.Tensor.__int__: "int",
        torch.Tensor.cpu: "cpu",
    }

    def __enter__(self) -> CountHostSyncs:
        self.calls: list[str] = []
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = self.READS.get(func)
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            name = "h2d"
        elif func is torch.Tensor.cuda or (
            func is torch.Tensor.to and any(_is_cuda(a) for a in (*args[1:], kwargs.get("device")))
        ):
            name = "h2d"
        if name is not None:
            self.calls.append(name)
        return func(*args, **kwargs)


def _is_cuda(device: object) -> bool:
    if isinstance(device, int):
        return True  # a CUDA ordinal
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


WORLD_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "barrier",
    "broadcast",
    "reduce",
    "reduce_scatter_tensor",
)


@contextmanager
def count_world_collectives():
    """Names of the torch.distributed collectives issued on the world group."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in WORLD_COLLECTIVES}

    def wrap(name, original):
        signature = inspect.signature(original)

        def counting(*args, **kwargs):
            group = signature.bind(*args, **kwargs).arguments.get("group")
            if group is None or group is dist.group.WORLD:
                calls.append(name)
            return original(*args, **kwargs)

        return counting

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@contextmanager
def replaced_prepare_grads(cls):
    """Replace ``cls.prepare_grads`` the way hardware-adaptation layers do (a class-level
    wrapper that calls the original); yields the list of optimizers it ran for."""
    calls: list = []
    original = cls.prepare_grads

    def replacement(self):
        calls.append(self)
        return original(self)

    cls.prepare_grads = replacement
    try:
        yield calls
    finally:
        cls.prepare_grads = original


class CaptureLogs(logging.Handler):
    """Collects the records of logger ``name`` (and its children) at ``level`` and above."""

    def __init__(self, name: str = "megatron", level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.logger = logging.getLogger(name)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, contains: str = "") -> list[str]:
        return [r.getMessage() for r in self.records if contains in r.getMessage()]

    def __enter__(self) -> CaptureLogs:
        self._level = self.logger.level
        self.logger.addHandler(self)
        if self.logger.getEffectiveLevel() > self.level:
            self.logger.setLevel(self.level)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)


Case = Callable[[], None]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    cases: dict[str, Case],
    out: Path,
    init: Callable[[], None] | None,
    shim: bool,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    results: dict[str, str] = {}
    try:
        # A file store, not the port: another process may take a free port before rank 0 binds it.
        store = f"file://{out / 'store'}"
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
        if init is not None:
            init()
        for name, case in cases.items():
            try:
                if shim:
                    with CudaOnCpu():
                        case()
                else:
                    case()
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - the traceback is the result
                results[name] = traceback.format_exc()
            dist.barrier()
    except Exception:  # noqa: BLE001
        results["<world>"] = traceback.format_exc()
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


def run_world(
    cases: dict[str, Case],
    world_size: int,
    out: Path,
    init: Callable[[], None] | None = None,
    shim: bool = True,
    timeout: float = 300.0,
) -> list[dict[str, str]]:
    """Run every case on every rank of a forked gloo world; per rank, name -> "ok" | traceback.

    ``init`` runs on each rank after the process group exists (e.g.
    ``parallel_state.initialize_model_parallel``). Cases run in order with a barrier between
    them, so a case may use collectives. A rank that dies or hangs fails the whole world.
    """
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, cases, out, init, shim))
        for r in range(world_size)
    ]
    # Ranks inherit the test process's heap (torch, megatron.core); frozen, the gc.collect()
    # that MCore calls (e.g. in sharded_state_dict) need not walk it in every rank.
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    # A rank that exits without every case run died (an import error before the rendezvous,
    # a crash): the others would wait for it until the timeout, so they are stopped at once.
    pending = {p.sentinel: (r, p) for r, p in enumerate(procs)}
    deadline = time.monotonic() + timeout
    first: tuple[int, str] | None = None  # the rank that died first, its error
    while pending and first is None:
        ready = multiprocessing.connection.wait(list(pending), deadline - time.monotonic())
        if not ready:
            break  # the timeout: the ranks still running are killed below
        for sentinel in ready:
            rank, p = pending.pop(sentinel)
            p.join()
            path = out / f"rank{rank}.json"
            got = json.loads(path.read_text()) if path.exists() else {}
            if first is None and (p.exitcode or "<world>" in got or cases.keys() - got.keys()):
                first = rank, got.get("<world>", f"exit code {p.exitcode} before every case ran")
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        got = json.loads(path.read_text()) if path.exists() else {"<world>": "no result"}
        if first and rank != first[0] and ("<world>" in got or cases.keys() - got.keys()):
            own = got.get("<world>", "stopped")
            got = {"<world>": f"rank {first[0]} died first:\n{first[1]}\n(this rank: {own})"}
        results.append(got)
    return results


World = tuple[int, Callable[[], None], dict[str, Case]]  # world size, init, cases


def run_worlds(worlds: dict[str, World], tmp_path_factory, after: Callable[[], None]) -> dict:
    """Run each named world once (``run_world``), then ``after`` (e.g. remove checkpoints)."""
    results = {}
    for name, (world_size, init, cases) in worlds.items():
        results[name] = run_world(cases, world_size, tmp_path_factory.mktemp(name), init=init)
    after()
    return results


def world_cases(worlds: dict[str, World]) -> list[tuple[str, str]]:
    """(world, case) for every case of every world: the parameters of a proof test."""
    return [(w, c) for w, (_, _, cases) in worlds.items() for c in cases]


def check(results: list[dict[str, str]], name: str) -> None:
    """Assert that case ``name`` passed on every rank (and that the world itself came up)."""
    for rank, per_rank in enumerate(results):
        assert "<world>" not in per_rank, f"rank {rank}: {per_rank['<world>']}"
        assert per_rank.get(name) == "ok", f"rank {rank}:\n{per_rank.get(name, 'not run')}"


# DistributedOptimizer (fix 2): real DDP + get_megatron_optimizer on CPU under CudaOnCpu.

DISTOPT_LOGGER = "megatron.core.optimizer.distrib_optimizer"


class MixedDtypeNet(torch.nn.Module):
    """bf16 Linear, fp32 child Linear, bf16 Linear (an fp32 submodule inside a bf16 model).

    DDP builds a bf16 grad buffer, then an fp32 one, so the weight group and the bias group
    each have 16-bit params before fp32 ones in grad-buffer order, while DistributedOptimizer
    stores each group as [*fp32 shards, *16-bit shards]. ``widths`` are the output widths of
    inp, child, out (equal widths: swapped shards have equal sizes). ``fp32_first`` declares
    the fp32 child first: DDP then builds the fp32 buffer first (groups already aligned).
    """

    def __init__(self, widths: tuple[int, int, int] = (64, 96, 32), fp32_first: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(sum(widths))
        layers = [
            ("inp", widths[0], torch.bfloat16),
            ("child", widths[1], torch.float32),
            ("out", widths[2], torch.bfloat16),
        ]
        if fp32_first:
            layers = [layers[1], layers[0], layers[2]]
        for name, width, dtype in layers:
            layer = torch.nn.Linear(128, width)
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
            setattr(self, name, layer.to(dtype))


def build_distopt(model_chunks: list[torch.nn.Module], ddp: dict | None = None, **config: object):
    """Real DDP per chunk and get_megatron_optimizer (torch Adam: no TE/apex on CPU).

    ``ddp``: more DistributedDataParallelConfig fields (e.g. ``overlap_grad_reduce`` and a small
    ``bucket_size``: several buckets; ``use_distributed_optimizer=False``: the mixed-precision
    optimizers without it). Returns (ddp chunks, optimizer as returned, its optimizers).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    ddp_config = DistributedDataParallelConfig(**{"use_distributed_optimizer": True, **(ddp or {})})
    chunks = [
        DistributedDataParallel(
            TransformerConfig(num_attention_heads=1, num_layers=1), ddp_config, chunk
        )
        for chunk in model_chunks
    ]
    kwargs = dict(optimizer="adam", lr=1e-2, bf16=True, clip_grad=0.0)
    distributed = ddp_config.use_distributed_optimizer
    opt_config = OptimizerConfig(use_distributed_optimizer=distributed, **{**kwargs, **config})
    optimizer = get_megatron_optimizer(opt_config, chunks)
    return chunks, optimizer, list(getattr(optimizer, "chained_optimizers", [optimizer]))


def distopt_step(chunks, optimizer, seed: int) -> None:
    """One optimizer step on seeded grads (written where backward would put them)."""
    gen = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        for p in chunk.module.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    optimizer.step()


def own_shards(opt) -> dict:
    """model param -> (group index, the shard the group stores for it), from the builder's
    groups (independent of model_param_group_index_map)."""
    shards = {}
    groups = zip(
        opt.model_fp32_groups, opt.shard_fp32_groups, opt.model_float16_groups, strict=True
    )
    for g, (fp32_params, fp32_shards, float16_params) in enumerate(groups):
        main_shards = opt.shard_fp32_from_float16_groups[g]
        for p, shard in [
            *zip(fp32_params, fp32_shards, strict=True),
            *zip(float16_params, main_shards, strict=True),
        ]:
            shards[p] = (g, shard)
    return shards


def own_state(opt) -> dict:
    """model param -> {"param": its own main shard, state key: tensor}, index-independent."""
    state = {}
    for p, (_, shard) in own_shards(opt).items():
        tensors = {"param": shard}
        tensors.update((k, v) for k, v in opt.optimizer.state.get(shard, {}).items() if k != "step")
        state[p] = tensors
    return state


def grad_buffer_order_index(opt) -> dict:
    """The index as MCore built it before the fix: params numbered in grad-buffer order."""
    return {
        p: (g, o) for g, r in enumerate(opt.opt_group_ranges) for o, p in enumerate(r["params"])
    }


def storage_order_index(opt) -> dict:
    """The index as upstream's dev fix (NVIDIA/Megatron-LM#5835) builds it."""
    return {
        p: (g, o)
        for g, (fp32, float16) in enumerate(
            zip(opt.model_fp32_groups, opt.model_float16_groups, strict=True)
        )
        for o, p in enumerate([*fp32, *float16])
    }


def param_names_by_name(chunks) -> dict:
    """name -> param over all model chunks (names prefixed with the chunk number)."""
    return {f"{i}.{n}": p for i, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}


class CudaSyncOnCpu:
    """``torch.cuda.synchronize()`` -> no-op (dist_checkpointing's writer calls it)."""

    def __enter__(self) -> CudaSyncOnCpu:
        self._synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *args, **kwargs: None
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize = self._synchronize


def clone_tensors(obj):
    """A copy of nested dicts/lists/tuples with every tensor detached and cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tensors(v) for v in obj)
    return copy.deepcopy(obj)


def sharding_types(opt) -> list[str]:
    """The distributed-checkpoint formats of this version's DistributedOptimizer, plus "legacy"
    (state_dict() + save_parameter_state(), torch.save of the DP-rank-0 gather)."""
    source = inspect.getsource(type(opt).sharded_state_dict)
    known = (
        "dp_reshardable",
        "fully_reshardable",
        "dp_zero_gather_scatter",
        "fully_sharded_model_space",
        "fully_sharded_bucket_space",
    )
    return ["legacy", *(t for t in known if f"'{t}'" in source or f'"{t}"' in source)]


class CheckpointDirs:
    """Checkpoint directories under one temp root, shared by the forked ranks of a proof."""

    def __init__(self, prefix: str = "distopt-ckpt-") -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self._ids = itertools.count()

    def new(self, tag: str) -> Path:
        """A fresh directory path, the same on every rank (ranks run the cases in one order)."""
        return self.root / f"{tag}-{next(self._ids)}"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def writer_queue_in_process() -> None:
    """dist_checkpointing.save's result queue as a plain queue of this rank: it would live in a
    spawned multiprocessing manager (~15 s of imports here, and it outlives the forked rank);
    its writers are threads of this rank."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def unrecorded(state):
    """A DistributedOptimizer's (common or sharded) state dict as MCore wrote it before it
    recorded its param index layout: no `param_index_layout`, the sharding type a plain name.
    Chained state (a list, or a dict of optimizers' state dicts) is handled per optimizer."""
    if isinstance(state, list):
        return [unrecorded(s) for s in state]
    if not isinstance(state, dict):
        return state
    if "param_state_sharding_type" not in state and "optimizer" not in state:
        return {k: unrecorded(v) for k, v in state.items()}
    state = {k: v for k, v in state.items() if k != "param_index_layout"}
    kind = state.get("param_state_sharding_type")
    if isinstance(kind, dict):
        state["param_state_sharding_type"] = kind["param_state_sharding_type"]
    return state


def _param_state_file(ckpt_dir: Path, i: int) -> Path:
    """The legacy parameter-state file of the i-th DistributedOptimizer, one per model-parallel
    rank (written and read by its data-parallel rank 0), as megatron/training's mp_rank_* dirs."""
    from megatron.core import parallel_state

    return ckpt_dir / f"param_state{i}.mp{parallel_state.get_model_parallel_group().rank()}.pt"


def _model_sharded_state_dict(chunks) -> dict:
    """The model's sharded state dict over all its chunks (their param names must differ)."""
    return {k: v for chunk in chunks for k, v in chunk.sharded_state_dict().items()}


def distopt_save(
    chunks,
    optimizer,
    opts,
    sharding_type: str,
    ckpt_dir: Path,
    old_index=False,
    recorded=None,
    with_model=False,
):
    """Save the optimizer state in `sharding_type`; with old_index, as MCore wrote it before
    the param-index fix (the grad-buffer-order index). `recorded=False` (the default with
    old_index) drops the layout record, as every version before it wrote. `with_model`: a
    torch_dist save holds the model weights too, as megatron/training's does. Collective over
    the world."""
    recorded = not old_index if recorded is None else recorded
    from megatron.core import dist_checkpointing

    writer_queue_in_process()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    indexes = [opt.model_param_group_index_map for opt in opts]
    if old_index:
        for opt in opts:
            opt.model_param_group_index_map = grad_buffer_order_index(opt)
    weights = {n: p.detach().clone() for n, p in param_names_by_name(chunks).items()}
    torch.save(weights, ckpt_dir / f"model{dist.get_rank()}.pt")
    try:
        with CudaSyncOnCpu():
            if sharding_type == "legacy":
                common = clone_tensors(optimizer.state_dict())
                torch.save(
                    common if recorded else unrecorded(common),
                    ckpt_dir / f"common{dist.get_rank()}.pt",
                )
                for i, opt in enumerate(opts):
                    opt.save_parameter_state(str(_param_state_file(ckpt_dir, i)))
            else:
                metadata = {"distrib_optim_sharding_type": sharding_type}
                model_sd = _model_sharded_state_dict(chunks)
                state = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
                if not recorded:
                    state = unrecorded(state)
                state = {"optimizer": state, **({"model": model_sd} if with_model else {})}
                dist_checkpointing.save(state, str(ckpt_dir))
    finally:
        for opt, index in zip(opts, indexes, strict=True):
            opt.model_param_group_index_map = index
    dist.barrier()


def distopt_load(
    chunks, optimizer, opts, sharding_type: str, ckpt_dir: Path, with_model=False
) -> list[str]:
    """Load what distopt_save wrote, model weights first (as checkpoint loading does); returns
    the WARNING messages of the optimizer's logger. `with_model`: a torch_dist checkpoint's
    model weights are loaded in the optimizer's load, as megatron/training loads them (in
    place: the loaded state of an fp32 param's main param and its weight share memory)."""
    from megatron.core import dist_checkpointing

    if not with_model or sharding_type == "legacy":
        weights = torch.load(ckpt_dir / f"model{dist.get_rank()}.pt")
        with torch.no_grad():
            for name, p in param_names_by_name(chunks).items():
                p.copy_(weights[name])

    with CudaSyncOnCpu(), CaptureLogs(DISTOPT_LOGGER, logging.WARNING) as logs:
        if sharding_type == "legacy":
            common = torch.load(ckpt_dir / f"common{dist.get_rank()}.pt", weights_only=False)
            optimizer.load_state_dict(common)
            for i, opt in enumerate(opts):
                opt.load_parameter_state(str(_param_state_file(ckpt_dir, i)))
        else:
            metadata = {"distrib_optim_sharding_type": sharding_type}
            model_sd = _model_sharded_state_dict(chunks)
            state = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
            request = {"optimizer": state, **({"model": model_sd} if with_model else {})}
            loaded = dist_checkpointing.load(request, str(ckpt_dir))
            if with_model:  # megatron/training: model.load_state_dict(), then the optimizer's
                with torch.no_grad():
                    for key, sharded in model_sd.items():
                        sharded.data.copy_(loaded["model"][key])
            optimizer.load_state_dict(loaded["optimizer"])
    return logs.messages()


# Formats a version lists but can no longer write (dist_checkpointing rejects them). Before 0.16
# the bucket-space save asserts every state tensor has the shard's shape, so it cannot hold torch
# Adam's per-param step (a 0-dim tensor).
DISTOPT_UNWRITABLE = (
    "flattened_range is not supported",
    "Unknown sharding_type",
    "(torch.Size([]), 0,",
)


def distopt_formats(opt) -> list[str]:
    """The formats a proof saves and loads. In these forked gloo worlds dist_checkpointing.save
    of 0.13 .. 0.15 hangs or loses a rank's result (measured on 0.13.1, 0.14.0, 0.15.3; 0.16.1
    and later pass in every format): there only the legacy format, saved with torch.save."""
    from megatron.core import package_info

    if (package_info.MAJOR, package_info.MINOR) < (0, 16):
        return ["legacy"]
    return [t for t in sharding_types(opt) if t != "fully_sharded_bucket_space"]


def distopt_save_if_writable(
    dirs: CheckpointDirs,
    chunks,
    optimizer,
    opts,
    sharding_type: str,
    old_index: bool = False,
    recorded: bool | None = None,
    with_model: bool = False,
):
    """A new directory of `dirs` written by distopt_save; None where the format is unwritable."""
    ckpt_dir = dirs.new(sharding_type)
    try:
        distopt_save(
            chunks, optimizer, opts, sharding_type, ckpt_dir, old_index, recorded, with_model
        )
    except Exception as e:  # noqa: BLE001
        if any(reason in str(e) for reason in DISTOPT_UNWRITABLE):
            return None
        raise
    return ckpt_dir


def init_data_parallel() -> None:
    """``init`` for run_world: MCore's default parallel state (data-parallel size = world size)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()


def init_data_parallel_of_one() -> None:
    """``init`` for run_world: every rank its own data-parallel group of one (tensor-parallel size
    = world size), so swapped shards of a param index have equal sizes on every rank."""
    from megatron.core import parallel_state

    world_size = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)


def load_te_standin():
    """tests/multigpu/te_standin.py: the FusedAdam stand-in the GPU tier uses too."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "multigpu" / "te_standin.py"
    spec = importlib.util.spec_from_file_location("te_standin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def precision_aware_config(**kwargs):
    """OptimizerConfig of a precision-aware Adam (override any field by keyword), built where
    TE's FusedAdam is the stand-in (the config checks that TE's FusedAdam exists)."""
    from megatron.core.optimizer import OptimizerConfig

    fields = dict(
        optimizer="adam",
        lr=1e-2,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
    )
    with load_te_standin().te_stand_in(te_modules=True):
        return OptimizerConfig(**(fields | kwargs))


class MultiTensorContract:
    """clip_grads' ``multi_tensor_applier`` held to TE's contract: no empty tensor list.

    TE's (and apex's) multi-tensor kernels dereference the first tensor of each list, so an
    empty list crashes the process; here it raises instead. Calls with non-empty lists go to
    the applier MCore chose (on CPU its local implementation), unchanged.
    """

    def __enter__(self) -> MultiTensorContract:
        from megatron.core.optimizer import clip_grads

        self._clip_grads = clip_grads
        self._applier = clip_grads.multi_tensor_applier
        self.calls: list[str] = []

        def applier(op, noop_flag, tensor_lists, *args):
            name = getattr(op, "__name__", repr(op))
            if any(len(tensor_list) == 0 for tensor_list in tensor_lists):
                raise AssertionError(
                    f"empty tensor list reached multi_tensor_applier({name}): TE's kernel "
                    "dereferences element 0 (a segfault)"
                )
            self.calls.append(name)
            return self._applier(op, noop_flag, tensor_lists, *args)

        clip_grads.multi_tensor_applier = applier
        return self

    def __exit__(self, *exc: object) -> None:
        self._clip_grads.multi_tensor_applier = self._applier


# Megatron-FSDP v1 as get_megatron_optimizer sees it. Megatron-FSDP's own buffers need CUDA;
# what the optimizer factory and the readers use of a FullyShardedDataParallel chunk is its
# `ddp_config`, DTensor parameters tagged `__fsdp_param__`, and a `param_and_grad_buffer` whose
# decoupled-grad flag is initialised and used like ParamAndGradBuffer's. The DDP field exists
# from MCore 0.18; the buffer attribute is `use_decoupled_grad` there, `use_precision_aware_
# optimizer` before (read with a default of False, set by nobody).
FSDP_DDP_FLAG = "megatron_fsdp_use_decoupled_grad"


def fsdp_buffer_flag() -> str:
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = DistributedDataParallelConfig.__dataclass_fields__
    return "use_decoupled_grad" if FSDP_DDP_FLAG in fields else "use_precision_aware_optimizer"


def has_fsdp_ddp_flag() -> bool:
    return fsdp_buffer_flag() == "use_decoupled_grad"


class FsdpGradBuffer:
    """ParamAndGradBuffer (Megatron-FSDP v1), as far as gradient installation goes: the flag
    is read from the DDP config like in its __init__, gradients are installed like at the end
    of its update_main_grads()."""

    def __init__(self, ddp_config) -> None:
        if has_fsdp_ddp_flag():
            setattr(self, fsdp_buffer_flag(), getattr(ddp_config, FSDP_DDP_FLAG))

    def installs_decoupled_grad(self) -> bool:
        return bool(getattr(self, fsdp_buffer_flag(), False))

    def update_main_grads(self, grads: dict) -> None:
        attr = "decoupled_grad" if self.installs_decoupled_grad() else "grad"
        for param, grad in grads.items():
            setattr(param, attr, grad)


class FsdpV1Chunk(torch.nn.Module):
    """What get_megatron_optimizer sees of a FullyShardedDataParallel (v1) model chunk."""

    def __init__(self, ddp_config, shapes=((4, 3), (5,)), requires_grad: bool = True) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        self.ddp_config = ddp_config
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for i, shape in enumerate(shapes):
            local = torch.randn(*shape)
            param = torch.nn.Parameter(
                DTensor.from_local(local, self.mesh, [Shard(0)]), requires_grad=requires_grad
            )
            param.__fsdp_param__ = True
            self.register_parameter(f"weight{i}", param)
        self.param_and_grad_buffer = FsdpGradBuffer(ddp_config)

    def make_grads(self, zeros_per_param: int = 2) -> dict:
        """Reduced gradients: DTensors with `zeros_per_param` zeros each."""
        from torch.distributed.tensor import DTensor

        grads = {}
        for param in self.parameters():
            local = torch.rand_like(param._local_tensor) + 0.5
            local.view(-1)[:zeros_per_param] = 0.0
            grads[param] = DTensor.from_local(local, self.mesh, param.placements)
        return grads


def fsdp_ddp_config(**kwargs):
    from megatron.core.distributed import DistributedDataParallelConfig

    base = dict(
        use_megatron_fsdp=True,
        use_distributed_optimizer=True,
        data_parallel_sharding_strategy="optim_grads_params",
    )
    return DistributedDataParallelConfig(**(base | kwargs))


def init_model_parallel() -> None:
    """``init`` for run_world: MCore's default parallel state (all sizes 1), a fixed seed."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)


# Megatron-FSDP (fully_shard) on a CPU mesh: its buffers overlap copies and reductions on CUDA
# streams and events. On the CPU every operation runs in order, so a stream is the one CPU
# queue: waits and records are no-ops, nothing else changes.


class _CpuStream:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> _CpuStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait_stream(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_event(self, *args: object, **kwargs: object) -> None:
        pass

    def record_event(self, *args: object, **kwargs: object) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


class _CpuEvent(_CpuStream):
    def record(self, *args: object, **kwargs: object) -> None:
        pass

    def wait(self, *args: object, **kwargs: object) -> None:
        pass

    def query(self) -> bool:
        return True


class CudaStreamsOnCpu:
    """``torch.cuda`` streams, events and ``synchronize`` -> in-order no-ops (with CudaOnCpu)."""

    NAMES = ("Stream", "Event", "current_stream", "default_stream", "stream", "synchronize")

    def __enter__(self) -> CudaStreamsOnCpu:
        self._saved = {name: getattr(torch.cuda, name) for name in self.NAMES}
        self._record_stream = torch.Tensor.record_stream
        torch.cuda.Stream, torch.cuda.Event = _CpuStream, _CpuEvent
        torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: _CpuStream()
        torch.cuda.stream = lambda *a, **k: _CpuStream()
        torch.cuda.synchronize = lambda *a, **k: None
        torch.Tensor.record_stream = lambda self, stream: None
        return self

    def __exit__(self, *exc: object) -> None:
        for name, value in self._saved.items():
            setattr(torch.cuda, name, value)
        torch.Tensor.record_stream = self._record_stream


# Expert parallelism under tensor parallelism (upstream #5916, #6099): MCore's own dense and
# expert layers in a world of 2 ranks with tensor-parallel size 2, grads written where backward
# puts them, and the grad norm and zero count the model really has.

EXPERT_HIDDEN, EXPERT_FFN, NUM_EXPERTS = 8, 16, 2  # at expert-parallel size 2: one per rank


def init_tp2_ep2() -> None:
    """``init``: tensor-parallel 2, expert-parallel 2, expert tensor-parallel 1 (world of 2): the
    two tensor-parallel ranks hold different experts."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    torch.manual_seed(5916)


def init_tp2_etp1() -> None:
    """``init``: tensor-parallel 2, no expert parallelism, expert tensor-parallel 1 (world of 2):
    both ranks hold the same experts, so expert data parallelism spans both."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=1, expert_tensor_parallel_size=1
    )
    torch.manual_seed(5916)


def expert_config(**kwargs):
    """TransformerConfig of the tensor-parallel MoE world (override any field by keyword)."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=EXPERT_HIDDEN,
        ffn_hidden_size=EXPERT_FFN,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=EXPERT_FFN,
        moe_router_topk=2,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
        add_bias_linear=True,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**(fields | kwargs))


def mpu_process_groups():
    """MCore's process groups, as MoE layers take them (ModelCommProcessGroups before 0.16)."""
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection as Groups
    except ImportError:
        from megatron.core.process_groups_config import ModelCommProcessGroups as Groups
    return Groups.use_mpu_process_groups()


class DenseAndExperts(torch.nn.Module):
    """A dense column-parallel linear (weight and bias split over tensor parallelism), a dense
    row-parallel linear (its bias replicated on both tensor-parallel ranks) and this rank's
    local experts (SequentialMLP: fc1 column-parallel, fc2 row-parallel with a bias, over the
    expert tensor-parallel group)."""

    def __init__(self, config) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP

        hidden, ffn = EXPERT_HIDDEN, EXPERT_FFN
        linear = dict(config=config, init_method=config.init_method, bias=True)
        self.dense_in = ColumnParallelLinear(hidden, ffn, gather_output=False, **linear)
        self.dense_out = RowParallelLinear(
            ffn, hidden, input_is_parallel=True, skip_bias_add=False, **linear
        )
        submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        local_experts = NUM_EXPERTS // config.expert_model_parallel_size
        self.experts = SequentialMLP(local_experts, config, submodules, mpu_process_groups())
        if config.bf16:
            self.to(torch.bfloat16)

    def is_replicated_dense(self, p) -> bool:
        return p is self.dense_out.bias

    def expert_biases(self) -> list[torch.Tensor]:
        """This rank's experts' fc2 biases: replicated over expert tensor parallelism."""
        return [
            p
            for n, p in self.named_parameters()
            if n.startswith("experts.") and n.endswith("linear_fc2.bias")
        ]

    def write_grads(self, expert_biases_only: bool = False) -> None:
        """Grads where backward puts them (``main_grad``): seeded, other on every rank, one zero
        per param (for the zero count), the replicated dense bias equal on both ranks.
        ``expert_biases_only``: ones in the experts' fc2 biases, zeros elsewhere."""
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        replicated = torch.Generator().manual_seed(7)  # equal on both ranks, as after backward
        biases = self.expert_biases()
        for p in self.parameters():
            if expert_biases_only:
                p.main_grad.fill_(1.0 if any(p is q for q in biases) else 0.0)
                continue
            grad = torch.rand(p.shape, generator=replicated if self.is_replicated_dense(p) else gen)
            grad = grad + 0.5
            grad.view(-1)[0] = 0.0
            p.main_grad.copy_(grad)

    def true_grad_stats(self) -> tuple[float, float, float]:
        """(norm, zeros, norm without tensor-parallel rank 1's expert biases) of the grads, each
        logical gradient once: every rank's dense shards and experts, the replicated dense bias
        once (rank 0's). Collective over the world."""
        sq, zeros, biases = 0.0, 0.0, 0.0
        rank_1_biases = self.expert_biases() if dist.get_rank() == 1 else []
        for p in self.parameters():
            if self.is_replicated_dense(p) and dist.get_rank() != 0:
                continue
            g = p.main_grad.float()
            sq += float(g.square().sum())
            zeros += float((g == 0).sum())
            if any(p is q for q in rank_1_biases):
                biases += float(g.square().sum())
        stats = torch.tensor([sq, zeros, biases], dtype=torch.float64)
        dist.all_reduce(stats)
        return float(stats[0].sqrt()), float(stats[1]), float((stats[0] - stats[2]).sqrt())


def check_grad_stats(model: DenseAndExperts, optimizer, expert_biases_only: bool = False) -> None:
    """One step of ``optimizer`` (clipping, zero counting) on the grads ``model.write_grads``
    puts: the grad norm and the zero count it reports are the model's."""
    import math

    model.write_grads(expert_biases_only)
    true_norm, true_zeros, without = model.true_grad_stats()
    _, grad_norm, num_zeros = optimizer.step()
    wrong = []
    if not math.isclose(float(grad_norm), true_norm, rel_tol=1e-4):
        wrong.append(
            f"grad norm {float(grad_norm):.4f}, true norm {true_norm:.4f} (without tensor-"
            f"parallel rank 1's expert biases: {without:.4f})"
        )
    if num_zeros != true_zeros:
        wrong.append(f"zeros counted {num_zeros}, true count {true_zeros:.0f}")
    assert not wrong, "; ".join(wrong)


# HybridDeviceOptimizer (--optimizer-cpu-offload) on the CPU: it offloads the params that report
# `is_cuda` to pinned host copies (`.cpu().pin_memory()`), steps those with its CPU optimizers
# and copies them back. Here every tensor stands for a device tensor except the host copies.

_ON_HOST = "_mcore_fixes_on_host"


def _on_host(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _ON_HOST, False)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _ON_HOST, True)
    return t


def _flat(values) -> list:
    """The values, and the items of those that are lists or tuples (one level)."""
    return [x for v in values for x in (v if isinstance(v, (list, tuple)) else [v])]


def _device_type(device: object) -> str | None:
    if isinstance(device, int):
        return "cuda"  # a CUDA ordinal
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type
    return None


class HostCopiesOnCpu(TorchFunctionMode):
    """Every tensor reports ``is_cuda``, except the host tensors: those made by ``.cpu()``,
    ``.to('cpu')``, ``pin_memory()``, a factory with ``device='cpu'`` or ``pin_memory=True``,
    and what is computed from them. A move to the host copies, as a device-to-host copy does;
    ``.cuda()`` / ``.to('cuda')`` of a host tensor copies it back to "the device"; pinning is
    otherwise a no-op. So HybridDeviceOptimizer offloads as on a GPU: its host copies go to its
    CPU sub-optimizers, which step them, and its hooks copy them back. Enter it inside
    ``CudaOnCpu`` and ``CudaStreamsOnCpu``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.is_cuda.__get__:  # a fresh method-wrapper per access
            return not _on_host(args[0])
        if func in (torch.Tensor.cpu, torch.Tensor.pin_memory):
            return args[0] if _on_host(args[0]) else _to_host(args[0].clone())
        if func is torch.Tensor.cuda:
            return args[0].clone() if _on_host(args[0]) else args[0]
        pinned = kwargs.pop("pin_memory", False)
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        device = _device_type(kwargs.get("device"))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and not any(out is a for a in args):
            if pinned or device == "cpu":
                _to_host(out)
            elif device is None and any(map(_on_host, _flat((*args, *kwargs.values())))):
                _to_host(out)
        return out

    @staticmethod
    def _to(args, kwargs):
        """``Tensor.to``: a device argument (positional or keyword) moves, the rest converts."""
        source, rest, device = args[0], [], kwargs.pop("device", None)
        for a in args[1:]:
            if _device_type(a) in ("cpu", "cuda"):
                device = a
            else:
                rest.append(a)
        out = torch.Tensor.to(source, *rest, **kwargs)
        target = _device_type(device)
        if target == "cpu" and not _on_host(source):
            return _to_host(out.clone() if out is source else out)
        if target == "cuda" and _on_host(source):
            out = out.clone() if out is source else out
            setattr(out, _ON_HOST, False)
            return out
        if out is not source and _on_host(source):
            _to_host(out)
        return out
