"""A real Megatron-FSDP v1 model (``FullyShardedDataParallel`` of megatron.core.distributed) on
the CPU, trained over several microbatches the way MCore's schedules drive it, for the proofs
of the fused weight-gradient patches.

Disclosed stand-ins, none of them in the code under test:

- ``CudaOnCpu`` / ``CudaStreamsOnCpu`` (_support): CUDA placement, streams and events on the CPU.
  Inside backward (autograd's own thread, where no torch function mode is active),
  ``torch.cuda.current_device()`` names the CPU.
- The device mesh of the data-parallel and tensor-parallel groups is built for the CPU (MCore
  asks for ``device_type="cuda"``). 0.14's Megatron-FSDP looks its mesh dimensions up in torch's
  private registry of sub-meshes (``_mesh_resources.child_to_root_mapping``), which the torch
  the proofs run on no longer has: an empty one stands in (the dimensions it looks up are the
  mesh's own, found by name).
- Transformer Engine's version is reported as 2.10 (Megatron-FSDP asserts it where gradient
  accumulation fusion is on) and ColumnParallelLinear sees the wgrad extension module as
  importable: its Megatron-FSDP branch never calls it (on the CPU the weight gradient is
  computed with torch, as MCore does without TE).
- ``TeFusedWgradLinear``: a linear layer whose backward writes its weight gradient into
  ``main_grad`` the way Transformer Engine's fused wgrad accumulation does under Megatron-FSDP
  (``get_main_grad()``; overwrite if ``overwrite_main_grad``, else add;
  ``grad_added_to_main_grad = True``; a dummy weight gradient).

Gradients are compared with plain autograd on an unwrapped copy: the data-parallel mean of each
rank's sum over its microbatches.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch
import torch.distributed as dist
from _support import CudaStreamsOnCpu, init_model_parallel, run_world

HIDDEN, VOCAB, NUM_MICROBATCHES = 8, 16, 4
TOLERANCE = 1e-5  # relative error of a step's gradient, fp32 on the CPU: about 1e-7
SOUND = "block.linear.weight"  # a plain nn.Linear: no fused wgrad
FUSED = ("block.te_linear.weight", "output_layer.weight")  # the fused-wgrad layers

# (strategy, overlap_grad_reduce): Megatron-FSDP requires the overlap for sharded gradients.
STRATEGIES = (
    ("no_shard", False),
    ("no_shard", True),
    ("optim", False),
    ("optim", True),
    ("optim_grads", True),
    ("optim_grads_params", True),
)


class _TeFusedWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        if hasattr(weight, "__fsdp_param__"):
            weight.main_grad = weight.get_main_grad()
        wgrad = grad_output.t().matmul(x)
        if getattr(weight, "overwrite_main_grad", False):
            weight.main_grad.copy_(wgrad)
        else:
            weight.main_grad.add_(wgrad)
        weight.grad_added_to_main_grad = True
        return grad_output.matmul(weight), torch.zeros_like(weight)


class TeFusedWgradLinear(torch.nn.Linear):
    """nn.Linear whose backward is TE's fused wgrad accumulation (see the module docstring);
    plain autograd where ``fused`` is False (the reference)."""

    def __init__(self, fused: bool) -> None:
        super().__init__(HIDDEN, HIDDEN, bias=False)
        self.fused = fused

    def forward(self, x):
        if self.fused:
            return _TeFusedWgrad.apply(x, self.weight)
        return super().forward(x)


class Block(torch.nn.Module):
    """An FSDP unit module (as a TransformerLayer is): a plain linear and a TE-style one."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.te_linear = TeFusedWgradLinear(fused)

    def forward(self, x):
        return torch.tanh(self.te_linear(torch.tanh(self.linear(x))))


class Net(torch.nn.Module):
    """A block, then a GPT-style output layer (ColumnParallelLinear, outside any FSDP unit),
    applied ``uses`` times: more than once, its weight is shared as with multi-token
    prediction."""

    def __init__(self, config, uses: int = 1) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear

        self.block = Block(config.gradient_accumulation_fusion)
        self.output_layer = ColumnParallelLinear(
            HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False
        )
        self.uses = uses

    def forward(self, x):
        hidden = self.block(x)
        return sum(self.output_layer(hidden * (i + 1))[0] for i in range(self.uses))


def _fsdp_on_cpu() -> None:
    """The stand-ins of the module docstring that stay for the rank's lifetime."""
    from megatron.core import utils as mcore_utils
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.tensor_parallel import layers
    from torch.distributed import DeviceMesh

    class CpuDeviceMesh:
        @staticmethod
        def from_group(*args, **kwargs):
            kwargs["device_type"] = "cpu"
            return DeviceMesh.from_group(*args, **kwargs)

    mcore_fsdp_adapter.DeviceMesh = CpuDeviceMesh
    try:
        from torch.distributed.device_mesh import _mesh_resources
    except ImportError:
        pass
    else:
        if not hasattr(_mesh_resources, "child_to_root_mapping"):
            _mesh_resources.child_to_root_mapping = {}
    mcore_utils._te_version = mcore_utils.PkgVersion("2.10.0")
    layers._grad_accum_fusion_available = True
    if not hasattr(layers, "fused_weight_gradient_mlp_cuda"):
        layers.fused_weight_gradient_mlp_cuda = types.ModuleType("fused_weight_gradient_mlp_cuda")
    sys.modules.setdefault("fused_weight_gradient_mlp_cuda", layers.fused_weight_gradient_mlp_cuda)


def train_step(strategy: str, overlap_grad_reduce: bool, uses: int = 1) -> dict[str, float]:
    """One step's gradients of a Megatron-FSDP v1 model (gradient accumulation fusion on),
    NUM_MICROBATCHES microbatches per rank, compared with plain autograd.

    Returns, per parameter name, the relative error of the gradient the optimizer would read
    (0.0: exact up to rounding; NaN where it holds NaN).
    """
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.transformer import TransformerConfig

    _fsdp_on_cpu()
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        gradient_accumulation_fusion=True,
        use_cpu_initialization=True,
    )
    reference = Net(dataclasses.replace(config, gradient_accumulation_fusion=False), uses)
    module = Net(config, uses)
    module.load_state_dict(reference.state_dict())
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        use_distributed_optimizer=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_grad_reduce,
        gradient_reduce_div_fusion=False,  # gloo has no PREMUL_SUM
    )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(5)
    inputs = [
        [torch.randn(3, HIDDEN, generator=generator) for _ in range(NUM_MICROBATCHES)]
        for _ in range(world_size)
    ]
    current_device = torch.cuda.current_device
    with CudaStreamsOnCpu():
        model = FullyShardedDataParallel(
            config, ddp_config, module, fsdp_unit_modules=[Block], device=torch.device("cpu")
        )
        torch.cuda.current_device = lambda: "cpu"
        try:
            model.zero_grad_buffer()
            for i, x in enumerate(inputs[rank]):
                if i < NUM_MICROBATCHES - 1:
                    with model.no_sync():
                        model(x).square().mean().backward()
                else:
                    model(x).square().mean().backward()
            model.finish_grad_sync()
        finally:
            torch.cuda.current_device = current_device
    for per_rank in inputs:
        for x in per_rank:
            (reference(x).square().mean() / world_size).backward()
    # Each rank holds a shard of each parameter (a contiguous range of its flattened elements,
    # all of it without sharding): it is found by its values in the unwrapped copy's weights.
    references = dict(reference.named_parameters())
    errors = {}
    for name, param in model.module.param_and_grad_buffer.optimizer_named_parameters:
        name = name.removeprefix("module.")
        local = getattr(param, "_local_tensor", param).detach().flatten()
        weight, expected = references[name].detach().flatten(), references[name].grad.flatten()
        sums = torch.zeros(2)
        if local.numel():
            start = int((weight - local[0]).abs().argmin())
            want = expected[start : start + local.numel()]
            grad = getattr(param.grad, "_local_tensor", param.grad).flatten()
            if torch.equal(weight[start : start + local.numel()], local):
                sums += torch.stack([(grad - want).square().sum(), want.square().sum()])
            else:  # not a range of this weight: reported as an infinite error, after the
                sums[0] = float("inf")  # collective (a raise here would hang the others)
        dist.all_reduce(sums)
        errors[name] = float(sums[0].sqrt() / sums[1].sqrt())
    return errors


def gradient_case(strategy: str, overlap_grad_reduce: bool, uses: int = 1, checked=FUSED):
    """A run_world case: `train_step` gives the parameters named in `checked` their step's
    gradient, within TOLERANCE of plain autograd's.

    Where `checked` leaves out the plain linear (SOUND), it is the control: a configuration in
    which the release's Megatron-FSDP gets a layer without fused wgrad wrong too (0.14, 0.15:
    optim_grads* at two ranks; 0.16: optim and optim_grads* at one rank, optim with overlapped
    reduction at two; 0.17: optim without overlapped reduction at two ranks) is beyond the
    fused-wgrad patches, said on the rank's stdout and not judged.
    """

    def case() -> None:
        errors = train_step(strategy, overlap_grad_reduce, uses)
        if SOUND not in checked and not errors[SOUND] < TOLERANCE:
            print(f"not judged: {strategy} gets {SOUND} wrong ({errors[SOUND]:.3g})")
            return
        wrong = {name: errors[name] for name in checked if not errors[name] < TOLERANCE}
        assert not wrong, (
            f"{strategy}, overlap_grad_reduce={overlap_grad_reduce}, output layer used {uses}x: "
            f"relative error of the step's gradient {wrong}"
        )

    return case


def dp_world(size: int, cases: dict, tmp_path_factory) -> list[dict[str, str]]:
    """Every case in a forked gloo world of `size` data-parallel ranks."""
    out = tmp_path_factory.mktemp(f"dp{size}")
    return run_world(cases, size, out, init=init_model_parallel)
