"""Proof of patch distopt-param-index: DistributedOptimizer indexes each param at its own shard.

``_build_model_and_main_param_groups`` stores every optimizer group as ``[*fp32 shards,
*16-bit shards]``; before the fix ``model_param_group_index_map`` numbered the params in
grad-buffer order, so where a 16-bit buffer precedes an fp32 one (an fp32 child module after
a bf16 one; VPP chunks) every state save and load path reads and writes other params' shards.
The fix is upstream's dev fix #5835: the index rebuilt from the builder's own groups (the cases
pass on dev). Checkpoints written with the old index are converted on load by patch
distopt-index-layout (test_distopt_index_layout.py).

Real objects: DistributedDataParallel, get_megatron_optimizer (torch Adam), the
DistributedOptimizer constructor and its save/load paths, in forked gloo worlds of 1 and 2
ranks (data-parallel sizes 1 and 2; and 2 ranks at data-parallel size 1). Disclosed stand-in:
``CudaOnCpu`` (CUDA placement and type names on the CPU).
"""

from __future__ import annotations

import megatron.core.dist_checkpointing  # noqa: F401 - imported once, before the ranks fork
import megatron.core.distributed  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import pytest
import torch
from _support import (
    CheckpointDirs,
    MixedDtypeNet,
    build_distopt,
    check,
    distopt_load,
    distopt_save,
    distopt_step,
    grad_buffer_order_index,
    init_data_parallel,
    init_data_parallel_of_one,
    own_shards,
    own_state,
    run_worlds,
    sharding_types,
    storage_order_index,
)

EQUAL = (32, 32, 32)  # equal shapes
CKPT = CheckpointDirs()  # shared by the forked ranks


def _reshardable(opt):
    """(get method, sharding type) of the per-rank bucket-space format of this version."""
    if hasattr(opt, "get_parameter_state_dp_reshardable"):
        return opt.get_parameter_state_dp_reshardable, "dp_reshardable"
    return opt.get_parameter_state_fs_bucket_space, "fully_sharded_bucket_space"


def _check_index(opts) -> None:
    for opt in opts:
        shards = own_shards(opt)
        for p, (g, o) in opt.model_param_group_index_map.items():
            stored = opt.optimizer.param_groups[g]["params"][o]
            assert shards[p][0] == g and stored is shards[p][1], (
                f"{tuple(p.shape)} {p.dtype} param indexed at ({g}, {o}), which holds a "
                f"{stored.numel()}-element shard of another param"
            )


def case_index_points_at_own_shard() -> None:
    _check_index(build_distopt([MixedDtypeNet()])[2])


def case_vpp_index_points_at_own_shard() -> None:
    _check_index(build_distopt([MixedDtypeNet(), MixedDtypeNet((48, 16, 80))])[2])


def case_index_equals_upstream_dev_fix() -> None:
    for chunks in ([MixedDtypeNet()], [MixedDtypeNet(), MixedDtypeNet((48, 16, 80))]):
        for opt in build_distopt(chunks)[2]:
            assert opt.model_param_group_index_map == storage_order_index(opt)


def case_saved_state_is_own() -> None:
    chunks, optimizer, opts = build_distopt([MixedDtypeNet()])
    distopt_step(chunks, optimizer, 0)
    for opt in opts:
        get_state, _ = _reshardable(opt)
        saved, own = get_state(), own_state(opt)
        for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
            for dtype, bucket_maps in gbuf_range_maps.items():
                for bucket_idx, bucket_map in enumerate(bucket_maps):
                    entries = saved[gbuf_idx][dtype][bucket_idx]
                    for entry, p in zip(entries, bucket_map["param_map"], strict=True):
                        for key, tensor in own[p].items():
                            assert torch.equal(entry[key], tensor), (key, tuple(p.shape))


def _save_load_reshardable(chunks, optimizer, opts, old_index: bool) -> list[str]:
    """Step, save in the bucket-space format (with the pre-fix index if old_index), step on,
    load. Returns the WARNING messages of the load."""
    sharding_type = "dp_reshardable"
    if sharding_type not in sharding_types(opts[0]):
        sharding_type = "fully_sharded_bucket_space"
    ckpt_dir = CKPT.new(sharding_type)  # same on every rank
    distopt_step(chunks, optimizer, 0)
    try:
        distopt_save(chunks, optimizer, opts, sharding_type, ckpt_dir, old_index=old_index)
    except AssertionError as e:
        if "(torch.Size([]), 0," in str(e):
            return []  # before 0.16 this format cannot hold torch Adam's step (a 0-dim tensor)
        raise
    distopt_step(chunks, optimizer, 1)
    # no_grad: loading into fp32 views needs it until patch distopt-no-grad-load.
    with torch.no_grad():
        return distopt_load(chunks, optimizer, opts, sharding_type, ckpt_dir)


def case_aligned_groups_unchanged_and_silent() -> None:
    chunks, optimizer, opts = build_distopt([MixedDtypeNet(EQUAL, fp32_first=True)])
    for opt in opts:
        assert [b.param_dtype for b in opt.buffers] == [torch.float32, torch.bfloat16]
        assert opt.model_param_group_index_map == grad_buffer_order_index(opt)
    assert _save_load_reshardable(chunks, optimizer, opts, old_index=True) == []


INDEX_CASES = {
    "index_points_at_own_shard": case_index_points_at_own_shard,
    "vpp_index_points_at_own_shard": case_vpp_index_points_at_own_shard,
    "index_equals_upstream_dev_fix": case_index_equals_upstream_dev_fix,
    "saved_state_is_own": case_saved_state_is_own,
    "aligned_groups_unchanged_and_silent": case_aligned_groups_unchanged_and_silent,
}
LOAD_CASES = {"aligned_groups_unchanged_and_silent": case_aligned_groups_unchanged_and_silent}
WORLDS = {
    "dp1": (1, init_data_parallel, {**INDEX_CASES, **LOAD_CASES}),
    "dp2": (2, init_data_parallel, INDEX_CASES),
    "2ranks-dp1": (2, init_data_parallel_of_one, LOAD_CASES),
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return run_worlds(WORLDS, tmp_path_factory, after=CKPT.remove)


CASES = [(w, c) for w, (_, _, cases) in WORLDS.items() for c in cases]


@pytest.mark.parametrize(("world", "case"), CASES, ids=[f"{w}-{c}" for w, c in CASES])
def test_distopt_param_index(worlds, world, case) -> None:
    check(worlds[world], case)
