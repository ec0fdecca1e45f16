"""Proof of patch distopt-reshardable-step: a dp_reshardable load keeps the checkpoint's Adam
step count, also with ``--optimizer-cpu-offload``.

torch's Adam(W) keeps a per-param "step" tensor: the HybridDeviceOptimizer's CPU sub-optimizers
(``optimizer_cpu_offload``), and torch Adam itself where neither TE nor apex is installed. The
dp_reshardable param state carries it as a ``LocalNonpersistentObject``, never saved: a load
hands back the run's own step tensor, and ``load_parameter_state_from_dp_reshardable`` copied it
over the step that ``load_state_dict`` had restored from the checkpoint's param groups. A resume
with offload went on at step 1 (the dummy step of a fresh HybridDeviceOptimizer) instead of the
checkpoint's, an in-process reload at the run's own step: Adam's bias corrections and the update
sizes after the load were wrong. The fix skips "step" there, as the other loaders do.

Real objects: DistributedDataParallel, get_megatron_optimizer (adam, bf16; with
``optimizer_cpu_offload`` and the precision-aware optimizer, the HybridDeviceOptimizer at offload
fractions 1.0 and 0.5), the DistributedOptimizer's sharded_state_dict, dist_checkpointing save
and load, in forked gloo worlds of 1 and 2 ranks. A run trains 3 steps, saves, trains 2 more; a
resumed run (a fresh model and optimizer for the offload cases; the same optimizer, rewound, for
torch Adam) loads the checkpoint and trains the same 2 steps: its steps and weights must be the
uninterrupted run's, bit for bit. Disclosed stand-ins: ``CudaOnCpu``, ``CudaStreamsOnCpu`` and
``HostCopiesOnCpu`` (CUDA placement, streams and the host copies of the offload on the CPU: see
_support.py), the precision-aware config built where TE's FusedAdam is its stand-in
(``precision_aware_config``), and ``HAVE_APEX_OR_TE`` of distrib_optimizer.py set for the offload
cases, as on a GPU machine with TE or apex (without them MCore cannot load torch_dist optimizer
state into a fresh optimizer at all: its ``state_dict()`` asserts on the empty state).
"""

from __future__ import annotations

import contextlib

import megatron.core.dist_checkpointing  # noqa: F401 - imported once, before the ranks fork
import megatron.core.distributed  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import pytest
import torch
from _support import (
    CheckpointDirs,
    CudaStreamsOnCpu,
    HostCopiesOnCpu,
    build_distopt,
    check,
    distopt_load,
    distopt_save,
    distopt_step,
    init_model_parallel,
    precision_aware_config,
    run_world,
)

CKPT = CheckpointDirs("reshardable-step-")  # shared by the forked ranks
SAVED_AT, MORE = 3, 2  # steps before the save, steps after it


class TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.inp, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.to(torch.bfloat16)


def _steps(opts) -> list[float]:
    """Each param's torch Adam step: the HybridDeviceOptimizer's sub-optimizers', or Adam's."""
    optimizers = [
        sub for opt in opts for sub in getattr(opt.optimizer, "sub_optimizers", [opt.optimizer])
    ]
    return [float(state["step"]) for o in optimizers for state in o.state.values()]


def _weights(chunks) -> list[torch.Tensor]:
    return [p.detach().clone() for p in chunks[0].module.parameters()]


def _offloaded(config):
    """DDP and get_megatron_optimizer with `config` (offload: a HybridDeviceOptimizer inside)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    chunk = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1),
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        TwoLinears(),
    )
    optimizer = get_megatron_optimizer(config, [chunk])
    return [chunk], optimizer, list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _train(chunks, optimizer, first: int, count: int) -> None:
    for seed in range(first, first + count):
        distopt_step(chunks, optimizer, seed)


@contextlib.contextmanager
def _apex_or_te_installed():
    from megatron.core.optimizer import distrib_optimizer

    saved = distrib_optimizer.HAVE_APEX_OR_TE
    distrib_optimizer.HAVE_APEX_OR_TE = True
    try:
        yield
    finally:
        distrib_optimizer.HAVE_APEX_OR_TE = saved


def _offload_resume(fraction: float) -> None:
    """Train, save (dp_reshardable), train on; a fresh model and optimizer load and train the
    same steps: the resumed run is the uninterrupted one."""
    config = precision_aware_config(
        bf16=True,
        clip_grad=0.0,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=fraction,
    )
    with _apex_or_te_installed(), CudaStreamsOnCpu(), HostCopiesOnCpu():
        chunks, optimizer, opts = _offloaded(config)
        offloaded = bool(opts[0].optimizer.cpu_optimizers)  # asserted after the collectives
        _train(chunks, optimizer, 0, SAVED_AT)
        ckpt_dir = CKPT.new("offload")
        distopt_save(chunks, optimizer, opts, "dp_reshardable", ckpt_dir)
        _train(chunks, optimizer, SAVED_AT, MORE)
        expected_steps, expected = _steps(opts), _weights(chunks)

        chunks, optimizer, opts = _offloaded(config)
        distopt_load(chunks, optimizer, opts, "dp_reshardable", ckpt_dir)
        loaded_steps = _steps(opts)
        _train(chunks, optimizer, SAVED_AT, MORE)
    assert offloaded, "the HybridDeviceOptimizer stepped no host copies"
    assert loaded_steps == [float(SAVED_AT)] * len(expected_steps), (
        f"Adam's step counts right after the load: {loaded_steps}"
    )
    assert _steps(opts) == expected_steps, (_steps(opts), expected_steps)
    got = _weights(chunks)
    deviation = max(
        float((a.float() - b.float()).abs().max()) for a, b in zip(got, expected, strict=True)
    )
    assert deviation == 0.0, f"resumed weights off the uninterrupted run's by up to {deviation}"


def case_offload_resume() -> None:
    _offload_resume(1.0)


def case_partial_offload_resume() -> None:
    _offload_resume(0.5)


def case_torch_adam_reload() -> None:
    """torch Adam (no TE/apex): the same optimizer, 2 steps past the save, loads the checkpoint
    back and trains those 2 steps again: it ends where it did the first time."""
    chunks, optimizer, opts = build_distopt([TwoLinears()])
    _train(chunks, optimizer, 0, SAVED_AT)
    ckpt_dir = CKPT.new("torch-adam")
    distopt_save(chunks, optimizer, opts, "dp_reshardable", ckpt_dir)
    _train(chunks, optimizer, SAVED_AT, MORE)
    expected_steps, expected = _steps(opts), _weights(chunks)

    distopt_load(chunks, optimizer, opts, "dp_reshardable", ckpt_dir)
    loaded_steps = _steps(opts)
    _train(chunks, optimizer, SAVED_AT, MORE)
    assert loaded_steps == [float(SAVED_AT)] * len(expected_steps), (
        f"Adam's step counts right after the load: {loaded_steps}"
    )
    assert _steps(opts) == expected_steps, (_steps(opts), expected_steps)
    assert all(map(torch.equal, _weights(chunks), expected)), "weights off the first run's"


CASES = {
    "offload_resume": case_offload_resume,
    "partial_offload_resume": case_partial_offload_resume,
    "torch_adam_reload": case_torch_adam_reload,
}
WORLD_SIZES = (1, 2)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    try:
        return {
            n: run_world(CASES, n, tmp_path_factory.mktemp(f"w{n}"), init=init_model_parallel)
            for n in WORLD_SIZES
        }
    finally:
        CKPT.remove()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES)
def test_distopt_reshardable_step(worlds, world_size, case) -> None:
    check(worlds[world_size], case)
