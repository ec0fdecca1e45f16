"""Fix 2 on two GPUs: DistributedOptimizer at DP=2 over a group that mixes bf16 and fp32 params.

Real DistributedDataParallel + DistributedOptimizer (get_megatron_optimizer, torch Adam: no
TE/apex) on a bf16 Linear, an fp32 child module and a bf16 Linear, so DDP builds a bf16 grad
buffer before an fp32 one and the optimizer group holds both; at DP=2 each rank owns half of
every buffer. Checked on every rank:
- after one step, each param's exp_avg is (1 - beta1) times its own reduced grad shard (the
  param index points at the param's own shard);
- save -> load into a fresh, clobbered model and optimizer is bit-exact, and training resumes
  bit-exactly against an uninterrupted run, for each torch_dist sharding type of the version and
  for the legacy state_dict() + save_parameter_state() path (gathered on DP rank 0).
Unpatched, saving fails (e.g. dp_reshardable: AssertionError on shard sizes) or state lands on
other params' shards.

Run on a host with 2 GPUs, with a patched tree (e.g. build/trees/main) on PYTHONPATH:

    PYTHONPATH=/path/to/tree torchrun --nproc_per_node=2 -m pytest \
        -o addopts= -q tests/multigpu/test_distopt_dp2.py

Skipped with fewer than 2 GPUs or outside torchrun (conftest.py).
"""

from __future__ import annotations

import copy
import inspect
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

BETA1 = 0.9
STEPS_AFTER_LOAD = 3
SHARDING_TYPES = (
    "dp_reshardable",
    "fully_reshardable",
    "fully_sharded_bucket_space",
    "fully_sharded_model_space",
    "dp_zero_gather_scatter",
)

Tensors = dict[str, torch.Tensor]


class Fp32Child(torch.nn.Module):
    """An fp32 submodule inside a bf16 model (as mark_keep_in_fp32 produces)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 192, device="cuda")  # 12288-element fp32 weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.float()).to(torch.bfloat16)


class MixedNet(torch.nn.Module):
    """bf16 Linear, fp32 child, bf16 Linear: DDP builds a bf16 buffer, then an fp32 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(128, 64, dtype=torch.bfloat16, device="cuda")
        self.child = Fp32Child()
        self.out = torch.nn.Linear(192, 32, dtype=torch.bfloat16, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.child(self.inp(x)))


@pytest.fixture
def shared_dir(dp_world: int) -> Iterator[Path]:
    """A directory both ranks see (pytest's tmp_path is per process)."""
    holder: list[Any] = [tempfile.mkdtemp(prefix="distopt_dp2_") if dp_world == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    yield Path(holder[0])
    dist.barrier()
    if dp_world == 0:
        shutil.rmtree(holder[0], ignore_errors=True)


def _model_and_optimizer() -> tuple[Any, Any, list[Any]]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(1234)  # same initial weights on both DP ranks
    model = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1),
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        MixedNet(),
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        adam_beta1=BETA1,
        weight_decay=0.0,
        clip_grad=0.0,
        bf16=True,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(config, [model])
    return model, optimizer, getattr(optimizer, "chained_optimizers", [optimizer])


def _train_step(model: Any, optimizer: Any, step: int) -> None:
    """One step; each DP rank gets its own deterministic batch."""
    seed = 100 + step + 10_000 * dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(16, 128, generator=gen, device="cuda").to(torch.bfloat16)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(x).float().square().mean().backward()
    model.finish_grad_sync()
    optimizer.step()


def _snapshot(model: Any, dist_optimizers: list[Any]) -> Tensors:
    """Copies of the model params and, per param, its main param and optimizer state shards."""
    names = {param: name for name, param in model.module.named_parameters()}
    state = {name: param.detach().clone() for name, param in model.module.named_parameters()}
    for opt in dist_optimizers:
        for param in opt.model_param_group_index_map:
            for key, value in opt._get_main_param_and_optimizer_states(param).items():
                if key != "step":
                    state[f"{names[param]}.{key}"] = value.detach().clone()
    return state


def _assert_bitwise_equal(actual: Tensors, expected: Tensors, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    differ = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert not differ, f"rank {dist.get_rank()}: {what}: not bit-exact: {differ}"


def test_dp2_state_is_each_params_own(dp_world: int) -> None:
    """After one Adam step every local param's exp_avg is (1 - beta1) * its own grad shard."""
    model, optimizer, dist_optimizers = _model_and_optimizer()
    dtypes = [buffer.param_dtype for buffer in dist_optimizers[0].buffers]
    assert dtypes == [torch.bfloat16, torch.float32], dtypes

    _train_step(model, optimizer, 0)
    checked = 0
    for opt in dist_optimizers:
        for param in opt.model_param_group_index_map:
            param_range = opt._get_model_param_range_map(param)["param"]
            own_grad = param.main_grad.view(-1)[param_range.start : param_range.end].float()
            tensors = opt._get_main_param_and_optimizer_states(param)
            assert tensors["param"].numel() == own_grad.numel()
            torch.testing.assert_close(tensors["exp_avg"], (1 - BETA1) * own_grad)
            checked += 1
    counts: list[Any] = [None, None]
    dist.all_gather_object(counts, checked)
    assert all(counts), f"local params checked per rank: {counts}"


def _round_trip(save: Callable[[Any, Any], None], load: Callable[[Any, Any], None]) -> None:
    """Step and save; train on (reference); resume a fresh, clobbered model and optimizer from
    the save: its state must equal the saved one, and training on must equal the reference,
    bit for bit."""
    model, optimizer, dist_optimizers = _model_and_optimizer()
    _train_step(model, optimizer, 0)
    saved = _snapshot(model, dist_optimizers)
    save(model, optimizer)
    for step in range(1, 1 + STEPS_AFTER_LOAD):
        _train_step(model, optimizer, step)
    reference = _snapshot(model, dist_optimizers)

    # Torch Adam (no TE/apex) needs allocated state to load into: clobber it with a step on
    # other data. Model weights are restored directly, optimizer state through the checkpoint.
    model, optimizer, dist_optimizers = _model_and_optimizer()
    _train_step(model, optimizer, 1000)
    with torch.no_grad():
        for name, param in model.module.named_parameters():
            param.copy_(saved[name])
    load(model, optimizer)
    _assert_bitwise_equal(_snapshot(model, dist_optimizers), saved, "restored state")
    # Without TE/apex, DistributedOptimizer.load_state_dict() gives all params of torch Adam one
    # shared "step" tensor, incremented once per param per step (a separate issue of the torch
    # fallback): give each param its own copy.
    for opt in dist_optimizers:
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
    for step in range(1, 1 + STEPS_AFTER_LOAD):
        _train_step(model, optimizer, step)
    _assert_bitwise_equal(_snapshot(model, dist_optimizers), reference, "resumed training")


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_dp2_dist_checkpoint_round_trip(
    dp_world: int, shared_dir: Path, sharding_type: str
) -> None:
    """torch_dist save -> load at DP=2 is bit-exact and training resumes bit-exactly."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    # Same decision on both ranks (a one-rank skip would leave the other in a collective).
    if sharding_type not in inspect.getsource(DistributedOptimizer.sharded_state_dict):
        pytest.skip(f"{sharding_type} is not a sharding type of this version")
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        filesystem_async = None
    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        pytest.skip("the torch_dist checkpoint writer of this version needs psutil")
    metadata = {"distrib_optim_sharding_type": sharding_type}
    ckpt_dir = shared_dir / sharding_type
    if dp_world == 0:
        ckpt_dir.mkdir()
    dist.barrier()

    def state_dict(model: Any, optimizer: Any, is_loading: bool) -> dict[str, Any]:
        model_sd = model.sharded_state_dict()
        return {
            "optimizer": optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=metadata
            )
        }

    def save(model: Any, optimizer: Any) -> None:
        try:
            sharded_state_dict = state_dict(model, optimizer, False)
        except Exception as e:  # a format this version dropped (raised alike on both ranks)
            if "Unknown sharding_type" in str(e) or "flattened_range is not supported" in str(e):
                pytest.skip(f"{sharding_type} is not supported by this version: {e}")
            raise
        dist_checkpointing.save(sharded_state_dict, str(ckpt_dir))

    def load(model: Any, optimizer: Any) -> None:
        loaded = dist_checkpointing.load(state_dict(model, optimizer, True), str(ckpt_dir))
        optimizer.load_state_dict(loaded["optimizer"])

    _round_trip(save, load)


def test_dp2_legacy_parameter_state_round_trip(dp_world: int, shared_dir: Path) -> None:
    """Legacy state_dict() + save_parameter_state() (gathered to DP rank 0) round trip."""
    filename = str(shared_dir / "param_state.pt")
    saved: dict[str, Any] = {}

    def save(model: Any, optimizer: Any) -> None:
        saved["state_dict"] = copy.deepcopy(optimizer.state_dict())
        optimizer.save_parameter_state(filename)
        dist.barrier()

    def load(model: Any, optimizer: Any) -> None:
        optimizer.load_state_dict(saved["state_dict"])
        optimizer.load_parameter_state(filename)

    _round_trip(save, load)
