"""Proof of patch distopt-index-layout: checkpoints say which param index wrote them.

Groups mixing fp32 and 16-bit params were indexed in grad-buffer order before the index fix
(patch distopt-param-index; upstream #5835 on dev), in storage order after it, and nothing in a
checkpoint said which. The fix records the layout in every checkpoint (`param_index_layout`);
a recorded checkpoint loads through its own index, with no value comparison, no collective and
no warning. An unrecorded one is read in storage order only where its main params fit only that
order, else in grad-buffer order (every release's), decided by one all-reduce for the
data-parallel group, and said in a warning where the values cannot tell (swapped params of
equal values); `MCORE_UNRECORDED_PARAM_INDEX_LAYOUT` overrides. Where an unrecorded reader's
grad-buffer-order index would misread the state, the saved sharding type (legacy: each buffer's
unpadded size) carries the record, which such readers refuse.

Real objects: DistributedDataParallel, get_megatron_optimizer (torch Adam), DistributedOptimizer,
ChainedOptimizer, dist_checkpointing save/load to files and the legacy torch.save path, in forked
gloo worlds of 1 and 2 ranks (and 2 ranks at data-parallel size 1, where the swapped shards have
equal sizes). Unrecorded checkpoints are written as MCore wrote them: through the grad-buffer-
order index it built (or the storage-order one), without the record. Disclosed stand-ins:
``CudaOnCpu`` and a no-op ``torch.cuda.synchronize`` for the checkpoint writer.
"""

from __future__ import annotations

import logging
import os

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
    run_worlds,
    unrecorded,
    world_cases,
)

CKPT = CheckpointDirs()  # shared by the forked ranks
EQUAL = (32, 32, 32)  # equal shapes: the old index saves without a size error
ENV = "MCORE_UNRECORDED_PARAM_INDEX_LAYOUT"


def _equal_net() -> MixedDtypeNet:
    """Every weight 1.0 (norm weights at their init): swapped params hold equal values."""
    net = MixedDtypeNet(EQUAL)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0)
    return net


def _assert_own_state(opts, saved, what: str) -> None:
    for opt, before in zip(opts, saved, strict=True):
        for (p, own), expected in zip(own_state(opt).items(), before, strict=True):
            for key, tensor in expected.items():
                assert torch.equal(own[key], tensor), (
                    f"{what}: the {tuple(p.shape)} {p.dtype} param got another param's {key}"
                )


def _round_trip(chunks_fn, sharding_type: str, old_index: bool, recorded: bool, **config):
    """Step, save, step on, load (model weights first); each param must get its own state back.
    Returns the WARNING lines of the load and its all-reduce count, or None (unwritable)."""
    chunks, optimizer, opts = build_distopt(chunks_fn(), **config)
    distopt_step(chunks, optimizer, 0)
    saved = [clone_tensors(list(own_state(opt).values())) for opt in opts]
    ckpt_dir = distopt_save_if_writable(
        CKPT, chunks, optimizer, opts, sharding_type, old_index, recorded
    )
    if ckpt_dir is None:
        return None
    distopt_step(chunks, optimizer, 1)
    with CountAllReduce() as calls:
        messages = distopt_load(chunks, optimizer, opts, sharding_type, ckpt_dir)
    _assert_own_state(opts, saved, f"{sharding_type}, old_index={old_index}")
    return messages, calls.calls


def _formats() -> list[str]:
    return distopt_formats(build_distopt([MixedDtypeNet(EQUAL)])[2][0])


def case_records_its_layout() -> None:
    """In every format; where the old index differs, readers without the record refuse it."""
    for net, guarded in ((MixedDtypeNet(EQUAL), True), (MixedDtypeNet(fp32_first=True), False)):
        chunks, optimizer, opts = build_distopt([net])
        distopt_step(chunks, optimizer, 0)
        (opt,) = opts
        common = opt.state_dict()
        assert common.get("param_index_layout") == "storage_order", sorted(common)
        for sharding_type in _formats():
            if sharding_type == "legacy":
                state = opt.get_parameter_state_dp_zero()
                if state is None:  # not DP rank 0
                    continue
                sizes = [s["numel_unpadded"] for g, d in state.items() if g != "buckets_coalesced"
                         for s in d.values()]  # fmt: skip
                assert any(isinstance(n, dict) for n in sizes) == guarded, sizes
                continue
            metadata = {"distrib_optim_sharding_type": sharding_type}
            try:
                with CudaSyncOnCpu():
                    state = opt.sharded_state_dict(
                        chunks[0].sharded_state_dict(), metadata=metadata
                    )
            except Exception:  # noqa: BLE001 - a format this version cannot write
                continue
            assert state["param_index_layout"] == "storage_order", sharding_type
            kind = state["param_state_sharding_type"]
            assert (kind != sharding_type) == guarded, (sharding_type, kind)
            if guarded:
                assert kind == {
                    "param_index_layout": "storage_order",
                    "param_state_sharding_type": sharding_type,
                }, kind


def case_recorded_checkpoint_loads_exactly_without_check() -> None:
    """No warning, and no more all-reduces than the load of a model whose index never moved."""
    for sharding_type in _formats():
        mixed = _round_trip(lambda: [MixedDtypeNet(EQUAL)], sharding_type, False, True)
        aligned = _round_trip(lambda: [MixedDtypeNet(EQUAL, fp32_first=True)], sharding_type,
                              False, True)  # fmt: skip
        if mixed is None or aligned is None:
            continue
        assert mixed[0] == [], (sharding_type, mixed[0])
        assert mixed[1] == aligned[1], f"{sharding_type}: all-reduces {mixed[1]} vs {aligned[1]}"


def case_recorded_equal_values_load_exactly() -> None:
    """Values that cannot tell the orders apart need nothing when the layout is recorded."""
    for sharding_type in _formats():
        result = _round_trip(lambda: [_equal_net()], sharding_type, False, True, lr=0.0)
        assert result is None or result[0] == [], (sharding_type, result)


def case_release_checkpoint_loads_exactly() -> None:
    """Unrecorded, grad-buffer order (every release): converted, no warning."""
    for sharding_type in _formats():
        result = _round_trip(lambda: [MixedDtypeNet(EQUAL)], sharding_type, True, False)
        assert result is None or result[0] == [], (sharding_type, result)


def case_release_checkpoint_of_equal_values_loads_exactly() -> None:
    """Unrecorded, grad-buffer order, swapped params of equal values (a warmup step at lr 0):
    read in grad-buffer order, and rank 0 says the values could not tell."""
    for sharding_type in _formats():
        result = _round_trip(lambda: [_equal_net()], sharding_type, True, False, lr=0.0)
        if result is None:
            continue
        messages = result[0]
        assert len(messages) == (1 if dist.get_rank() == 0 else 0), (sharding_type, messages)
        assert all(ENV in m and "both orders" in m for m in messages), messages


def case_unrecorded_storage_order_checkpoint_loads_exactly() -> None:
    """Unrecorded, storage order (upstream dev with #5835): its values fit only that order."""
    for sharding_type in _formats():
        result = _round_trip(lambda: [MixedDtypeNet(EQUAL)], sharding_type, False, False)
        assert result is None or result[0] == [], (sharding_type, result)


def case_override_reads_unrecorded_storage_order() -> None:
    """Equal values written in storage order without a record: the override reads them."""
    os.environ[ENV] = "storage_order"
    try:
        result = _round_trip(lambda: [_equal_net()], "legacy", False, False, lr=0.0)
    finally:
        del os.environ[ENV]
    assert result[0] == [], result


def case_vpp_release_checkpoint_loads_exactly() -> None:
    """Two model chunks (VPP), legacy format."""
    chunks = lambda: [MixedDtypeNet(EQUAL), MixedDtypeNet(EQUAL)]  # noqa: E731
    assert _round_trip(chunks, "legacy", True, False)[0] == []


def case_chained_release_checkpoint_loads_exactly() -> None:
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
        common = unrecorded(clone_tensors(chain.state_dict()))
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
    assert logs.messages() == [], logs.messages()


def case_same_collectives_on_every_rank() -> None:
    """Data-parallel size 2: every rank issues the same all-reduces in a load, whatever it owns;
    an unrecorded load adds one to a recorded one, an aligned model none."""
    counts = []
    for net, recorded in (
        (MixedDtypeNet(), False),
        (MixedDtypeNet(), True),
        (MixedDtypeNet(fp32_first=True), False),
    ):
        result = _round_trip(lambda net=net: [net], "legacy", False, recorded)
        counts.append(result[1])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counts)
    assert all(c == everyone[0] for c in everyone), f"all-reduces per rank: {everyone}"
    assert counts[0] == counts[1] + 1 == counts[2] + 1, f"unrecorded/recorded/aligned: {counts}"


UNRECORDED = {
    "release_checkpoint_loads_exactly": case_release_checkpoint_loads_exactly,
    "release_checkpoint_of_equal_values_loads_exactly": (
        case_release_checkpoint_of_equal_values_loads_exactly
    ),
    "vpp_release_checkpoint_loads_exactly": case_vpp_release_checkpoint_loads_exactly,
    "chained_release_checkpoint_loads_exactly": case_chained_release_checkpoint_loads_exactly,
    "unrecorded_storage_order_checkpoint_loads_exactly": (
        case_unrecorded_storage_order_checkpoint_loads_exactly
    ),
    "override_reads_unrecorded_storage_order": case_override_reads_unrecorded_storage_order,
}
RECORDED = {
    "records_its_layout": case_records_its_layout,
    "recorded_checkpoint_loads_exactly_without_check": (
        case_recorded_checkpoint_loads_exactly_without_check
    ),
    "recorded_equal_values_load_exactly": case_recorded_equal_values_load_exactly,
}
WORLDS = {
    "dp1": (1, init_data_parallel, {**RECORDED, **UNRECORDED}),
    "dp2": (
        2,
        init_data_parallel,
        {
            "recorded_checkpoint_loads_exactly_without_check": (
                case_recorded_checkpoint_loads_exactly_without_check
            ),
            "same_collectives_on_every_rank": case_same_collectives_on_every_rank,
        },
    ),
    "2ranks-dp1": (2, init_data_parallel_of_one, UNRECORDED),
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return run_worlds(WORLDS, tmp_path_factory, after=CKPT.remove)


WORLD_CASES = world_cases(WORLDS)


@pytest.mark.parametrize(("world", "case"), WORLD_CASES, ids=[f"{w}-{c}" for w, c in WORLD_CASES])
def test_distopt_index_layout(worlds, world, case) -> None:
    check(worlds[world], case)
