"""Proof of patch distopt-missing-state-key: every checkpoint format loads with torch Adam.

With torch's Adam (no TE/apex), each param's optimizer state has a "step" tensor that the
fully_reshardable, fully_sharded_model_space and dp_zero formats (legacy included) do not
carry: ``_set_main_param_and_optimizer_states`` raised ``KeyError: 'step'``. The fix skips
exactly that key (load_state_dict() restores it from the param groups) and raises a KeyError
naming the key and the param for any other missing state.

Real objects: DistributedDataParallel, get_megatron_optimizer (torch Adam), the
DistributedOptimizer, dist_checkpointing save/load to files and the legacy torch.save path,
in forked gloo worlds of 1 and 2 ranks. Disclosed stand-ins: ``CudaOnCpu`` and a no-op
``torch.cuda.synchronize`` for the checkpoint writer.
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
    clone_tensors,
    distopt_formats,
    distopt_load,
    distopt_save_if_writable,
    distopt_step,
    init_data_parallel,
    own_shards,
    own_state,
    run_worlds,
    world_cases,
)

CKPT = CheckpointDirs()  # shared by the forked ranks


def case_every_format_round_trip() -> None:
    """Save, step on, load: main params, moments and the step restored bit-exactly."""
    for sharding_type in distopt_formats(build_distopt([MixedDtypeNet()])[2][0]):
        chunks, optimizer, opts = build_distopt([MixedDtypeNet()])
        distopt_step(chunks, optimizer, 0)
        saved = [clone_tensors(list(own_state(opt).values())) for opt in opts]
        ckpt_dir = distopt_save_if_writable(CKPT, chunks, optimizer, opts, sharding_type)
        if ckpt_dir is None:
            continue
        distopt_step(chunks, optimizer, 1)
        distopt_load(chunks, optimizer, opts, sharding_type, ckpt_dir)
        for opt, before in zip(opts, saved, strict=True):
            for own, expected in zip(own_state(opt).values(), before, strict=True):
                for key, tensor in expected.items():
                    assert torch.equal(own[key], tensor), f"{sharding_type}: {key} differs"
            steps = [opt.optimizer.state[shard]["step"] for _, shard in own_shards(opt).values()]
            # dp_reshardable holds the live step tensor (a LocalNonpersistentObject).
            if sharding_type != "dp_reshardable":
                assert all(float(s) == 1.0 for s in steps), (sharding_type, steps)


def case_missing_state_key_raises() -> None:
    """A loaded state without exp_avg_sq: KeyError naming the key and the param."""
    chunks, optimizer, opts = build_distopt([MixedDtypeNet()])
    distopt_step(chunks, optimizer, 0)
    opt = opts[0]
    param = chunks[0].module.inp.weight
    state = opt._get_main_param_and_optimizer_states(param)
    tensors = {k: v.detach().clone() for k, v in state.items()}
    del tensors["exp_avg_sq"], tensors["step"]
    with pytest.raises(KeyError) as raised:
        with torch.no_grad():
            opt._set_main_param_and_optimizer_states(param, tensors)
    assert "exp_avg_sq" in str(raised.value) and "inp.weight" in str(raised.value), raised.value


CASES = {
    "every_format_round_trip": case_every_format_round_trip,
    "missing_state_key_raises": case_missing_state_key_raises,
}
WORLDS = {"dp1": (1, init_data_parallel, CASES), "dp2": (2, init_data_parallel, CASES)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return run_worlds(WORLDS, tmp_path_factory, after=CKPT.remove)


WORLD_CASES = world_cases(WORLDS)


@pytest.mark.parametrize(("world", "case"), WORLD_CASES, ids=[f"{w}-{c}" for w, c in WORLD_CASES])
def test_distopt_missing_state_key(worlds, world, case) -> None:
    check(worlds[world], case)
