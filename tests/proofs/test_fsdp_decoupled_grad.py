"""Proof of fsdp-decoupled-grad: Megatron-FSDP v1 installs gradients where the optimizer reads.

With a precision-aware optimizer (TE's FusedAdam) under Megatron-FSDP v1, FusedAdam reads
`param.decoupled_grad`, while the gradient buffer installs into `param.grad` unless told
otherwise (`DistributedDataParallelConfig.megatron_fsdp_use_decoupled_grad`, default False,
from 0.18; before that a buffer attribute nobody sets). Left at default, FusedAdam skips every
parameter (weights frozen), the grad norm is 0 and clipping sees no gradient. After the fix
every chunk's buffer follows the optimizer config, decided alike on every rank whatever it
owns; the caller's DDP config is read and never written (chunks may share one); a True the
optimizer cannot honour is a ValueError at setup, on every rank.

Real MCore: OptimizerConfig, DistributedDataParallelConfig, get_megatron_optimizer,
DistributedOptimizer, clip_grads, in forked gloo worlds of 1 and 2. Stand-ins, outside the
code under test: TE's FusedAdam (tests/multigpu/te_standin.py), the Megatron-FSDP v1 chunk and
buffer of _support (Megatron-FSDP's own buffers need CUDA). The GPU tier (docs/gpu/) runs the
real Megatron-FSDP v1.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from _support import (
    FSDP_DDP_FLAG,
    CaptureLogs,
    FsdpV1Chunk,
    MultiTensorContract,
    check,
    fsdp_ddp_config,
    has_fsdp_ddp_flag,
    init_model_parallel,
    load_te_standin,
    precision_aware_config,
    run_world,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

te_standin = load_te_standin()


def _config(precision_aware: bool, **kwargs) -> OptimizerConfig:
    return precision_aware_config(
        use_precision_aware_optimizer=precision_aware, log_num_zeros_in_grad=True, **kwargs
    )


def _build(config: OptimizerConfig, chunks: list):
    with te_standin.te_stand_in(te_modules=False):
        return get_megatron_optimizer(config, chunks, use_gloo_process_groups=False)


def _default_follows_the_optimizer() -> None:
    for precision_aware in (True, False):
        chunk = FsdpV1Chunk(fsdp_ddp_config())
        with CaptureLogs("megatron.core.optimizer", logging.INFO) as logs:
            optimizer = _build(_config(precision_aware), [chunk])
        reads = bool(optimizer.optimizer.use_decoupled_grad)
        installs = chunk.param_and_grad_buffer.installs_decoupled_grad()
        assert installs == reads, (
            f"use_precision_aware_optimizer={precision_aware}: FusedAdam reads "
            f"{'decoupled_grad' if reads else 'grad'}, Megatron-FSDP installs "
            f"{'decoupled_grad' if installs else 'grad'}"
        )
        if has_fsdp_ddp_flag():
            assert getattr(chunk.ddp_config, FSDP_DDP_FLAG) is False, "the caller's config written"
            # The buffer differs from the config only for the precision-aware optimizer: said once.
            said = logs.messages("param.decoupled_grad, where")
            assert len(said) == int(precision_aware), f"logged {said}"


def _chunks_sharing_a_ddp_config() -> None:
    """Two chunks wrapped with one DDP config, built with different optimizers: each buffer
    follows its own optimizer and the shared config is never written (a precision-aware
    optimizer for the first used to flip it, and torch Adam for the second then raised)."""
    ddp_config = fsdp_ddp_config()
    chunks = [FsdpV1Chunk(ddp_config), FsdpV1Chunk(ddp_config)]
    reads = []
    for chunk, precision_aware in zip(chunks, (True, False), strict=True):
        optimizer = _build(_config(precision_aware), [chunk])
        reads.append(bool(optimizer.optimizer.use_decoupled_grad))
    installs = [chunk.param_and_grad_buffer.installs_decoupled_grad() for chunk in chunks]
    assert reads == [True, False], f"FusedAdam reads decoupled_grad per chunk: {reads}"
    assert installs == reads, f"Megatron-FSDP installs decoupled_grad {installs}, read {reads}"
    if has_fsdp_ddp_flag():
        assert getattr(ddp_config, FSDP_DDP_FLAG) is False, "the shared config was written"


def _contradiction_raises_at_setup() -> None:
    if not has_fsdp_ddp_flag():
        return  # no DDP flag before 0.18: nothing can be set against the optimizer
    chunk = FsdpV1Chunk(fsdp_ddp_config(**{FSDP_DDP_FLAG: True}))
    try:
        _build(_config(False), [chunk])
    except ValueError as error:
        message = str(error)
        assert FSDP_DDP_FLAG in message and "use_precision_aware_optimizer" in message, message
    else:
        raise AssertionError(
            f"{FSDP_DDP_FLAG}=True with an optimizer that reads param.grad was accepted: every "
            "gradient would be installed where the optimizer does not read"
        )


def _frozen_chunk_with_flag_true() -> None:
    """Compatibility: what megatron/training and Bridge set, on a chunk with nothing to train."""
    if not has_fsdp_ddp_flag():
        return
    frozen = FsdpV1Chunk(fsdp_ddp_config(**{FSDP_DDP_FLAG: True}), requires_grad=False)
    optimizer = _build(_config(True, fp8_recipe="mxfp8"), [frozen])
    assert not optimizer.get_parameters()


def _step_reads_where_fsdp_writes() -> None:
    clip_grad = 0.5
    chunk = FsdpV1Chunk(fsdp_ddp_config())
    config = _config(True, clip_grad=clip_grad)
    optimizer = _build(config, [chunk])
    grads = chunk.make_grads(zeros_per_param=2)
    chunk.param_and_grad_buffer.update_main_grads(grads)
    expected = math.sqrt(sum(float(g._local_tensor.square().sum()) for g in grads.values()))
    before = [p._local_tensor.clone() for p in chunk.parameters()]
    with MultiTensorContract():
        grad_norm = float(optimizer.clip_grad_norm(clip_grad))
        num_zeros = optimizer.count_zeros()
    assert math.isclose(grad_norm, expected, rel_tol=1e-5), (
        f"grad norm {grad_norm}, expected {expected}: the norm reads no gradient"
    )
    clipped = math.sqrt(sum(float(g._local_tensor.square().sum()) for g in grads.values()))
    assert math.isclose(clipped, clip_grad, rel_tol=1e-4), f"not clipped: {clipped}"
    assert num_zeros == 2 * len(grads), num_zeros
    optimizer.optimizer.step()  # FusedAdam, as DistributedOptimizer.step_with_ready_grads calls it
    after = [p._local_tensor for p in chunk.parameters()]
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True)), "weights frozen"


def _every_rank_decides_alike() -> None:
    """Rank 0 owns parameters, rank 1 none (its chunk is frozen): both set their buffer from
    the optimizer config, and a contradictory DDP flag raises on both, never on one only
    (the other would go on to the next collective and hang)."""
    owns = torch.distributed.get_rank() == 0
    settings = [(True, {})]  # a precision-aware optimizer, the DDP config left at default
    if has_fsdp_ddp_flag():
        settings.append((False, {FSDP_DDP_FLAG: True}))
    outcomes = []
    for precision_aware, flag in settings:
        chunk = FsdpV1Chunk(fsdp_ddp_config(**flag), requires_grad=owns)
        try:
            _build(_config(precision_aware), [chunk])
        except ValueError:
            outcomes.append("ValueError")
        else:
            outcomes.append(chunk.param_and_grad_buffer.installs_decoupled_grad())
    per_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, outcomes)
    assert per_rank == [[True, "ValueError"][: len(settings)]] * len(per_rank), (
        f"per rank, [installs decoupled_grad with a precision-aware optimizer, outcome of "
        f"{FSDP_DDP_FLAG}=True with another]: {per_rank}"
    )


_CASES = {
    "default_follows_the_optimizer": _default_follows_the_optimizer,
    "chunks_sharing_a_ddp_config": _chunks_sharing_a_ddp_config,
    "contradiction_raises_at_setup": _contradiction_raises_at_setup,
    "frozen_chunk_with_flag_true": _frozen_chunk_with_flag_true,
    "step_reads_where_fsdp_writes": _step_reads_where_fsdp_writes,
}


_TWO_RANK_CASES = {"every_rank_decides_alike": _every_rank_decides_alike}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(
        _CASES, world_size=1, out=tmp_path_factory.mktemp("fsdp"), init=init_model_parallel
    )


@pytest.mark.parametrize("case", list(_CASES))
def test_fsdp_decoupled_grad(results, case):
    check(results, case)


def test_every_rank_decides_alike(tmp_path):
    """The decision never depends on what a rank owns."""
    two_ranks = run_world(_TWO_RANK_CASES, world_size=2, out=tmp_path, init=init_model_parallel)
    check(two_ranks, "every_rank_decides_alike")
