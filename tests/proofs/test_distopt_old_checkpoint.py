"""Proof of patch distopt-old-checkpoint: checkpoints of the grad-buffer-order index load exactly.

Before the index fix (patch distopt-param-index; upstream #5835 on dev) MCore saved the
params of groups mixing fp32 and 16-bit params through a grad-buffer-order index, so such a
checkpoint holds, under each moved param, another param's state; the fixed index loaded it
permuted (main params and moments of other params, silently, where sizes agree). The fix
recognises such a checkpoint from the loaded main params of the 16-bit params (each equals its
model weight, loaded first, in the order it was written in), decides once per load for the
data-parallel group (one all-reduce, issued on every rank alike) and gives each param its own
state back, logging one line on rank 0; correct checkpoints load silently, and a checkpoint
neither index fits is named in a warning. Checkpoints are written exactly as unpatched MCore
writes them: through the grad-buffer-order index it built.

Real objects: DistributedDataParallel, get_megatron_optimizer (torch Adam), the
DistributedOptimizer, ChainedOptimizer, dist_checkpointing save/load to files and the legacy
torch.save path, in forked gloo worlds of 1 and 2 ranks (and 2 ranks at data-parallel size 1,
where the swapped shards have equal sizes). Disclosed stand-ins: ``CudaOnCpu`` and a no-op
``torch.cuda.synchronize`` for the checkpoint writer.
"""

from __future__ import annotations

import logging

import megatron.core.dist_checkpointing  # noqa: F401 - imported once, before the ranks fork
import megatron.core.distributed  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import pytest
import torch
import torch.distributed as dist
from _support import (
    DISTOPT_LOGGER,
    CaptureLogs,
    CheckpointDirs,
    CountAllReduce,
    CudaSyncOnCpu,
    MixedDtypeNet,
    build_distopt,
    check,
    clone_tensors,
    distopt_formats,
    distopt_load,
    distopt_save_if_writable,
    distopt_step,
    grad_buffer_order_index,
    init_data_parallel,
    init_data_parallel_of_one,
    own_state,
    param_names_by_name,
    run_worlds,
    world_cases,
)

CKPT = CheckpointDirs()  # shared by the forked ranks
EQUAL = (32, 32, 32)  # equal shapes: the old index saves without a size error


def _assert_own_state(opts, saved, what: str) -> None:
    for opt, before in zip(opts, saved, strict=True):
        for (p, own), expected in zip(own_state(opt).items(), before, strict=True):
            for key, tensor in expected.items():
                assert torch.equal(own[key], tensor), (
                    f"{what}: the {tuple(p.shape)} {p.dtype} param got another param's {key}"
                )


def _assert_logged(messages: list[str], converted: int) -> None:
    """`converted` conversion lines on rank 0, nothing on the other ranks, no other warning."""
    expected = converted if dist.get_rank() == 0 else 0
    assert len(messages) == expected, messages
    assert all("converted" in m for m in messages), messages


def _round_trip(chunks_fn, sharding_type: str, old_index: bool) -> list[str] | None:
    chunks, optimizer, opts = build_distopt(chunks_fn())
    distopt_step(chunks, optimizer, 0)
    saved = [clone_tensors(list(own_state(opt).values())) for opt in opts]
    ckpt_dir = distopt_save_if_writable(CKPT, chunks, optimizer, opts, sharding_type, old_index)
    if ckpt_dir is None:
        return None
    distopt_step(chunks, optimizer, 1)
    messages = distopt_load(chunks, optimizer, opts, sharding_type, ckpt_dir)
    _assert_own_state(opts, saved, f"{sharding_type}, old_index={old_index}")
    return messages


def case_old_checkpoint_loads_exactly_in_every_format() -> None:
    for sharding_type in distopt_formats(build_distopt([MixedDtypeNet(EQUAL)])[2][0]):
        messages = _round_trip(lambda: [MixedDtypeNet(EQUAL)], sharding_type, old_index=True)
        if messages is not None:
            _assert_logged(messages, converted=1)


def case_new_checkpoint_loads_silently_in_every_format() -> None:
    for sharding_type in distopt_formats(build_distopt([MixedDtypeNet()])[2][0]):
        messages = _round_trip(lambda: [MixedDtypeNet()], sharding_type, old_index=False)
        assert messages in (None, []), (sharding_type, messages)


def case_old_vpp_checkpoint_loads_exactly() -> None:
    """Two model chunks (VPP), legacy format."""
    chunks = lambda: [MixedDtypeNet(EQUAL), MixedDtypeNet(EQUAL)]  # noqa: E731
    _assert_logged(_round_trip(chunks, "legacy", old_index=True), converted=1)


def case_aligned_old_checkpoint_loads_silently() -> None:
    """fp32 buffers first: the index never changed, the old checkpoint is a new one."""
    chunks = lambda: [MixedDtypeNet(EQUAL, fp32_first=True)]  # noqa: E731
    assert _round_trip(chunks, "legacy", old_index=True) == []


def case_old_chained_checkpoint_loads_exactly() -> None:
    """ChainedOptimizer of two DistributedOptimizers (as dense + expert), legacy format: its own
    save_parameter_state / load_parameter_state, which call each child's dp_zero loader."""
    from megatron.core.optimizer import ChainedOptimizer

    built = [build_distopt([MixedDtypeNet(EQUAL)]) for _ in range(2)]
    chunks = [chunk for b in built for chunk in b[0]]
    opts = [b[2][0] for b in built]
    chain = ChainedOptimizer(opts)
    distopt_step(chunks, chain, 0)
    saved = [clone_tensors(list(own_state(opt).values())) for opt in opts]
    ckpt_dir = CKPT.new("chained")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    weights = [clone_tensors(list(c.parameters())) for c in chunks]
    indexes = [opt.model_param_group_index_map for opt in opts]
    for opt in opts:
        opt.model_param_group_index_map = grad_buffer_order_index(opt)
    try:
        common = clone_tensors(chain.state_dict())
        chain.save_parameter_state(str(ckpt_dir / f"param_state{dist.get_rank()}.pt"))
    finally:
        for opt, index in zip(opts, indexes, strict=True):
            opt.model_param_group_index_map = index
    dist.barrier()
    distopt_step(chunks, chain, 1)
    with torch.no_grad():
        for chunk, chunk_weights in zip(chunks, weights, strict=True):
            for p, w in zip(chunk.parameters(), chunk_weights, strict=True):
                p.copy_(w)
    with CudaSyncOnCpu(), CaptureLogs(DISTOPT_LOGGER, logging.WARNING) as logs:
        chain.load_state_dict(common)
        chain.load_parameter_state(str(ckpt_dir / f"param_state{dist.get_rank()}.pt"))
    _assert_own_state(opts, saved, "chained legacy")
    _assert_logged(logs.messages(), converted=2)


def case_neither_index_fits_warns() -> None:
    """Model weights that belong to neither order: each rank names its params, no conversion."""
    chunks, optimizer, opts = build_distopt([MixedDtypeNet(EQUAL)])
    distopt_step(chunks, optimizer, 0)
    ckpt_dir = distopt_save_if_writable(CKPT, chunks, optimizer, opts, "legacy", old_index=True)
    weights = {n: p.detach() + 1.0 for n, p in param_names_by_name(chunks).items()}
    torch.save(weights, ckpt_dir / f"model{dist.get_rank()}.pt")  # not the weights saved
    messages = distopt_load(chunks, optimizer, opts, "legacy", ckpt_dir)
    assert len(messages) == 1, messages
    assert "match neither" in messages[0] and "inp.weight" in messages[0], messages


def case_same_collectives_on_every_rank() -> None:
    """Data-parallel size 2: every rank issues the same all-reduces in a load, whatever it owns;
    a model without a 16-bit buffer before an fp32 one issues none for the check."""
    counts = []
    for net in (MixedDtypeNet(), MixedDtypeNet(fp32_first=True)):
        chunks, optimizer, opts = build_distopt([net])
        distopt_step(chunks, optimizer, 0)
        ckpt_dir = distopt_save_if_writable(
            CKPT, chunks, optimizer, opts, "legacy", old_index=False
        )
        with CountAllReduce() as calls:
            assert distopt_load(chunks, optimizer, opts, "legacy", ckpt_dir) == []
        counts.append(calls.calls)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counts)
    assert all(c == everyone[0] for c in everyone), f"all-reduces per rank: {everyone}"
    assert counts[0] == counts[1] + 1, f"mixed-buffer vs aligned loads: {counts}"


OLD_CHECKPOINTS = {
    "old_checkpoint_loads_exactly_in_every_format": (
        case_old_checkpoint_loads_exactly_in_every_format
    ),
    "old_vpp_checkpoint_loads_exactly": case_old_vpp_checkpoint_loads_exactly,
    "old_chained_checkpoint_loads_exactly": case_old_chained_checkpoint_loads_exactly,
    "aligned_old_checkpoint_loads_silently": case_aligned_old_checkpoint_loads_silently,
    "neither_index_fits_warns": case_neither_index_fits_warns,
}
NEW_CHECKPOINTS = {
    "new_checkpoint_loads_silently_in_every_format": (
        case_new_checkpoint_loads_silently_in_every_format
    ),
}
WORLDS = {
    "dp1": (1, init_data_parallel, {**OLD_CHECKPOINTS, **NEW_CHECKPOINTS}),
    "dp2": (
        2,
        init_data_parallel,
        {**NEW_CHECKPOINTS, "same_collectives_on_every_rank": case_same_collectives_on_every_rank},
    ),
    "2ranks-dp1": (2, init_data_parallel_of_one, OLD_CHECKPOINTS),
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return run_worlds(WORLDS, tmp_path_factory, after=CKPT.remove)


WORLD_CASES = world_cases(WORLDS)


@pytest.mark.parametrize(("world", "case"), WORLD_CASES, ids=[f"{w}-{c}" for w, c in WORLD_CASES])
def test_distopt_old_checkpoint(worlds, world, case) -> None:
    check(worlds[world], case)
