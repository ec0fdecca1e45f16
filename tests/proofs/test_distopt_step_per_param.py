"""Proof of patch distopt-step-per-param: a load gives each param its own torch Adam step.

With torch's Adam (no TE/apex), each param's optimizer state has a "step" tensor that Adam
increments in place at every step. ``DistributedOptimizer.load_state_dict`` restored it from
the param groups as one tensor shared by every param, so each step after a load incremented
it once per param: the bias corrections of Adam went wrong from the first step after resuming.
The fix gives each param its own copy.

Real objects: DistributedDataParallel, get_megatron_optimizer (torch Adam), the
DistributedOptimizer and its state_dict / load_state_dict, in forked gloo worlds of 1 and 2
ranks. Disclosed stand-in: ``CudaOnCpu`` (CUDA placement and type names on the CPU).
"""

from __future__ import annotations

import megatron.core.distributed  # noqa: F401 - imported once, before the ranks fork
import megatron.core.optimizer  # noqa: F401
import pytest
from _support import (
    MixedDtypeNet,
    build_distopt,
    check,
    distopt_step,
    init_data_parallel,
    own_shards,
    run_world,
)


def _steps(opts) -> list[float]:
    return [
        float(opt.optimizer.state[shard]["step"])
        for opt in opts
        for _, shard in own_shards(opt).values()
    ]


def case_step_after_load_counts_once() -> None:
    """Step, load the state dict back, step: every param's step is 2."""
    chunks, optimizer, opts = build_distopt([MixedDtypeNet()])
    distopt_step(chunks, optimizer, 0)
    optimizer.load_state_dict(optimizer.state_dict())
    assert _steps(opts) == [1.0] * len(_steps(opts))
    distopt_step(chunks, optimizer, 1)
    steps = _steps(opts)
    assert steps == [2.0] * len(steps), f"steps after one step past the load: {steps}"


def case_vpp_step_after_load_counts_once() -> None:
    chunks, optimizer, opts = build_distopt([MixedDtypeNet(), MixedDtypeNet((48, 16, 80))])
    for seed in range(2):
        distopt_step(chunks, optimizer, seed)
    optimizer.load_state_dict(optimizer.state_dict())
    distopt_step(chunks, optimizer, 2)
    steps = _steps(opts)
    assert steps == [3.0] * len(steps), steps


CASES = {
    "step_after_load_counts_once": case_step_after_load_counts_once,
    "vpp_step_after_load_counts_once": case_vpp_step_after_load_counts_once,
}
WORLD_SIZES = (1, 2)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return {
        n: run_world(CASES, n, tmp_path_factory.mktemp(f"w{n}"), init=init_data_parallel)
        for n in WORLD_SIZES
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES)
def test_distopt_step_per_param(worlds, world_size, case) -> None:
    check(worlds[world_size], case)
