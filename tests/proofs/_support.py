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

import json
import logging
import multiprocessing
import os
import socket
import traceback
from collections.abc import Callable
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
        if device is not None and torch.device(device).type == "cuda":
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
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
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
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"<world>": "no result"})
    return results


def check(results: list[dict[str, str]], name: str) -> None:
    """Assert that case ``name`` passed on every rank (and that the world itself came up)."""
    for rank, per_rank in enumerate(results):
        assert "<world>" not in per_rank, f"rank {rank}: {per_rank['<world>']}"
        assert per_rank.get(name) == "ok", f"rank {rank}:\n{per_rank.get(name, 'not run')}"
