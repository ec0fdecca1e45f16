"""Proof of fsdp-fused-wgrad-accumulate: under Megatron-FSDP, a weight gradient written straight
into ``main_grad`` (gradient accumulation fusion) adds every microbatch of the step.

ColumnParallelLinear (a GPT model's output layer; RowParallelLinear shares its backward) wrote
the weight gradient with ``out=main_grad``, so the step kept the last microbatch's alone
wherever Megatron-FSDP accumulates the step in ``main_grad``: `no_shard` and `optim`, and every
strategy at a data-parallel size of 1. Transformer Engine's layers overwrite where Megatron-FSDP
sets ``overwrite_main_grad``, which it set from the strategy name: `optim_grads` and
`optim_grads_params` at a data-parallel size of 1 dropped microbatches in TE's layers too. The
rule is now the buffer's own: overwrite where each microbatch gets a fresh (sharded) bucket,
add elsewhere; a weight used twice in one backward pass (the output layer shared with
multi-token prediction) adds its second use in either case.

Real MCore: FullyShardedDataParallel (Megatron-FSDP v1) and ColumnParallelLinear with gradient
accumulation fusion, in forked gloo worlds of 1 and 2 ranks, every sharding strategy, with and
without overlapped gradient reduction; stand-ins (tests/proofs/_megatron_fsdp_v1.py): the CPU
placement shims and a TE-style fused-wgrad linear.
"""

from __future__ import annotations

import pytest
from _megatron_fsdp_v1 import STRATEGIES, dp_world, gradient_case
from _support import check

# The output layer used twice per microbatch matters where main_grad is a fresh bucket
# (sharded gradients): a second use must add to the first, not overwrite it.
CASES = {
    f"{strategy}-overlap{int(overlap)}-uses{uses}": gradient_case(strategy, overlap, uses)
    for strategy, overlap in STRATEGIES
    for uses in ((1, 2) if strategy.startswith("optim_grads") else (1,))
}


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def world(request, tmp_path_factory):
    return dp_world(request.param, CASES, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_fused_wgrad_accumulate(world, case):
    check(world, case)
