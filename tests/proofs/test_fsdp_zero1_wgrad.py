"""Proof of fsdp-zero1-wgrad (upstream #6357): Megatron-FSDP v1 without sharded gradients
(`no_shard`, `optim`) keeps every microbatch's gradient.

Megatron-FSDP set ``overwrite_main_grad`` on every parameter, so Transformer Engine's fused
weight-gradient accumulation overwrote the unsharded gradient buffer of `optim` (ZeRO-1) on
each microbatch: the step kept the last microbatch's gradient alone. Where the release reduces
the unsharded buffers after every backward pass with ``overlap_grad_reduce`` off, a second,
redundant reduction left the gradients of every layer off (0.74x at a data-parallel size of 2,
0.17 and later; the backports to 0.15 .. 0.17 carry the overwrite change alone, and this proof
checks the reduction from 0.18 on). Upstream's fix overwrites only where the gradient is
sharded and reduces unsharded buffers once, on the last microbatch.

Real MCore: FullyShardedDataParallel (Megatron-FSDP v1) in forked gloo worlds of 1 and 2 ranks,
`no_shard` and `optim` with and without overlapped gradient reduction; what is checked is the
step's gradient of a plain linear and of a TE-style fused-wgrad linear in an FSDP unit against
plain autograd. Stand-ins: tests/proofs/_megatron_fsdp_v1.py.
"""

from __future__ import annotations

import pytest
from _megatron_fsdp_v1 import FUSED, SOUND, STRATEGIES, dp_world, gradient_case
from _support import check


def _checked() -> tuple[str, ...]:
    """Not the output layer (fix 6). The plain linear (the single reduction of unsharded buffers
    with overlap_grad_reduce off) from 0.18 on: the backports to 0.15 .. 0.17 leave it out."""
    from megatron.core import package_info

    if (package_info.MAJOR, package_info.MINOR) < (0, 18):
        return (FUSED[0],)
    return (SOUND, FUSED[0])


CHECKED = _checked()
CASES = {
    f"{strategy}-overlap{int(overlap)}": gradient_case(strategy, overlap, checked=CHECKED)
    for strategy, overlap in STRATEGIES
    if strategy in ("no_shard", "optim")
}


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def world(request, tmp_path_factory):
    return dp_world(request.param, CASES, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_zero1_wgrad(world, case):
    check(world, case)
