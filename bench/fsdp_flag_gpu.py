"""Fix 3 on one GPU: real Megatron-FSDP v1, DDP flag at default / True / contradictory.

`megatron_fsdp_use_decoupled_grad` left at its default (False) or set True, with the
precision-aware optimizer (TE's FusedAdam, here `FusedAdamStandIn` of tests/multigpu/
te_standin.py, which follows its documented contract), and True with an optimizer that reads
`param.grad` (the contradiction). Three steps each with clipping below the norm. Prints one
JSON line per case: setup error or not, grad norm, whether the main weights moved, the DDP
flag after setup, and multi_tensor_applier calls that got an empty tensor list (where TE's
kernels would crash).

    PYTHONPATH=/path/to/tree torchrun --nproc_per_node=1 bench/fsdp_flag_gpu.py
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "multigpu")
)
from te_standin import te_stand_in  # noqa: E402

CLIP_GRAD = 1e-3
FLAG = "megatron_fsdp_use_decoupled_grad"


@contextlib.contextmanager
def empty_kernel_calls() -> Iterator[list[str]]:
    from megatron.core.optimizer import clip_grads

    original = clip_grads.multi_tensor_applier
    empty: list[str] = []

    def recording(op: Any, noop_flag: Any, tensor_lists: Any, *args: Any) -> Any:
        if any(len(tensor_list) == 0 for tensor_list in tensor_lists):
            empty.append(getattr(op, "__name__", repr(op)))
            return None
        return original(op, noop_flag, tensor_lists, *args)

    clip_grads.multi_tensor_applier = recording
    try:
        yield empty
    finally:
        clip_grads.multi_tensor_applier = original


def run_case(flag: bool | None, precision_aware: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(1234)
    ddp = dict(
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
    )
    if flag is not None:
        ddp[FLAG] = flag
    module = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    ).cuda()
    model = FullyShardedDataParallel(
        config=TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=16),
        ddp_config=DistributedDataParallelConfig(**ddp),
        module=module,
        fsdp_unit_modules=[torch.nn.Linear],
    )
    with te_stand_in(te_modules=True):
        config = OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            use_distributed_optimizer=True,
            use_precision_aware_optimizer=precision_aware,
            clip_grad=CLIP_GRAD,
        )
    try:
        with te_stand_in(te_modules=False):
            optimizer = get_megatron_optimizer(config, [model])
    except ValueError as error:
        return {"setup": "ValueError", "message": str(error)}
    main = [getattr(p, "_local_tensor", p) for p in optimizer.get_parameters()]
    before = [w.detach().clone() for w in main]
    norms = []
    with empty_kernel_calls() as empty:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 16, device="cuda")).square().mean().backward()
            model.finish_grad_sync()
            ok, grad_norm, _ = optimizer.step()
            norms.append(None if grad_norm is None else float(grad_norm))
    torch.cuda.synchronize()
    return {
        "setup": "ok",
        "update_successful": bool(ok),
        "grad_norms": norms,
        "weights_moved": any(not torch.equal(b, w) for b, w in zip(before, main, strict=True)),
        "fused_adam_reads": "decoupled_grad" if optimizer.optimizer.use_decoupled_grad else "grad",
        "ddp_flag_after_setup": getattr(model.ddp_config, FLAG, None),
        "empty_list_kernel_calls": len(empty),
    }


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    cases = {
        "flag default, precision-aware": (None, True),
        "flag True, precision-aware": (True, True),
        "flag True, optimizer reads .grad (contradictory)": (True, False),
    }
    for name, (flag, precision_aware) in cases.items():
        print(json.dumps({"case": name} | run_case(flag, precision_aware)), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
