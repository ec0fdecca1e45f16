"""Fix 1 on two GPUs: MIMO non-colocated, encoder grid on GPU 0 and LLM grid on GPU 1 (NCCL).

A real MimoModel (tiny encoder and LLM modules, each wrapped in MCore's
DistributedDataParallel and owning its grid's ProcessGroupCollection) and the real
`get_mimo_optimizer`, FP16 with dynamic loss scaling (initial scale 8, hysteresis 1,
loss_scale_window 2). Each step the LLM rank's loss scale is broadcast to the encoder rank,
which scales its backward by it: that stands in for the gradient the encoder receives from
the LLM in a real pipeline. The loss is linear in the weights, so the true gradients are the
same every step and the global grad norm MimoOptimizer.step() returns is known in advance.

Step 0 overflows in the encoder grid only. Patched: both steps skipped, loss scales
[4.0, 4.0]; then three clean steps in lockstep (same flag, scales and grad norm on both
ranks; the scales grow to 8 after two clean steps on both). Unpatched the scales after step 0
are [4.0, 8.0], and on the next steps the encoder unscales by 4 a gradient the LLM scaled by 8:
its grad norm doubles.

Run on a host with 2 GPUs, with a patched tree (e.g. build/trees/main) on PYTHONPATH:

    PYTHONPATH=/path/to/tree torchrun --nproc_per_node=2 -m pytest \
        -o addopts= -q tests/multigpu/test_mimo_disjoint_grids.py

Skipped with fewer than 2 GPUs or outside torchrun (conftest.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

ENCODER = "images"
HIDDEN = 16
BATCH = 4
INITIAL_SCALE = 8.0


class TinyModule(MegatronModule):
    """The test's model: a bias-free linear layer owning its grid's process groups."""

    def __init__(self, config: Any, pg_collection: Any) -> None:
        super().__init__(config=config)
        self.pg_collection = pg_collection
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _grid(offset: int) -> Any:
    """One-rank grid with the groups upstream's MIMO tests create (collective: all ranks)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grid = HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "pp", "dp"], rank_offset=offset, backend="nccl")
    grid.register_view(
        "expert",
        shape=[1, 1, 1, 1],
        dim_names=["expt_tp", "ep", "pp", "expt_dp"],
        shared_dims=["pp"],
    )
    for dims in (["tp"], ["cp"], ["pp"], ["dp"], ["dp", "cp"], ["tp", "pp"]):
        grid.create_pg(dims)
    grid.create_pg(["tp", "cp", "dp", "pp"])
    for dims in (["ep"], ["expt_dp"], ["expt_tp", "ep", "pp"]):
        grid.create_pg(dims, view="expert")
    return grid


def _pg_collection(grid: Any) -> Any:
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    pgs.tp = grid.get_pg("tp")
    pgs.cp = grid.get_pg("cp")
    pgs.pp = grid.get_pg("pp")
    pgs.ep = grid.get_pg("ep", view="expert")
    pgs.dp = grid.get_pg("dp")
    pgs.dp_cp = grid.get_pg(["dp", "cp"])
    pgs.expt_dp = grid.get_pg("expt_dp", view="expert")
    pgs.mp = grid.get_pg(["tp", "pp"])
    pgs.tp_ep_pp = grid.get_pg(["expt_tp", "ep", "pp"], view="expert")
    pgs.intra_dist_opt = grid.get_pg(["tp", "cp", "dp", "pp"])
    return pgs


def _build(rank: int) -> tuple[Any, Any, torch.nn.Module]:
    """MimoModel (encoder grid on rank 0, LLM grid on rank 1), its DDP module on this rank and
    the optimizer from get_mimo_optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.mimo.config.base_configs import MimoModelConfig
    from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY
    from megatron.core.models.mimo.model.base import MimoModel
    from megatron.core.models.mimo.optimizer import get_mimo_optimizer
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    grids = {ENCODER: _grid(0), MIMO_LANGUAGE_MODULE_KEY: _grid(1)}
    pgs = {name: _pg_collection(grid) for name, grid in grids.items()}
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True
    )
    encoder_spec = ModuleSpec(
        module=VisionModalitySubmodules,
        params={"pg_collection": pgs[ENCODER]},
        submodules={
            "encoders": {
                "enc": ModuleSpec(
                    module=TinyModule, params={"config": config, "pg_collection": pgs[ENCODER]}
                )
            }
        },
    )
    llm_spec = ModuleSpec(
        module=TinyModule,
        params={"config": config, "pg_collection": pgs[MIMO_LANGUAGE_MODULE_KEY]},
    )
    mimo_model = MimoModel(
        MimoModelConfig(
            language_model_spec=llm_spec,
            modality_submodules_spec={ENCODER: encoder_spec},
            special_token_ids={ENCODER: 50257},
            module_to_grid_map=grids,
        )
    )
    torch.manual_seed(1234 + rank)
    mimo_model.cuda().half()
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    if rank == 0:
        submodule = mimo_model.modality_submodules[ENCODER]
        ddp = DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=submodule, pg_collection=pgs[ENCODER]
        )
        mimo_model.modality_submodules[ENCODER] = ddp
        compute = submodule.encoders["enc"]
    else:
        assert mimo_model.language_model is not None
        compute = mimo_model.language_model
        ddp = DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=compute,
            pg_collection=pgs[MIMO_LANGUAGE_MODULE_KEY],
        )
        mimo_model.language_model = ddp
    opt_config = OptimizerConfig(
        optimizer="sgd",
        lr=0.01,
        clip_grad=1.0,
        fp16=True,
        initial_loss_scale=INITIAL_SCALE,
        min_loss_scale=1.0,
        loss_scale_window=2,
        hysteresis=1,
        use_distributed_optimizer=False,
    )
    return get_mimo_optimizer(mimo_model, opt_config), ddp, compute


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed input x and output cotangent g of this rank's module: dL/dW = g^T x."""
    gen = torch.Generator().manual_seed(77 + rank)
    x = torch.randint(-2, 3, (BATCH, HIDDEN), generator=gen).float()
    g = torch.randint(-2, 3, (BATCH, HIDDEN), generator=gen).float() / 8
    return x, g


def _expected_grad_norm() -> float:
    norms_sq = [float((g.t() @ x).square().sum()) for x, g in map(_inputs, (0, 1))]
    return sum(norms_sq) ** 0.5


def _scaler_states(optimizer: Any) -> list[dict[str, float]]:
    """States of every grad scaler of this rank's module optimizer (a ChainedOptimizer)."""
    states = []
    for info in optimizer.module_infos.values():
        if not info.is_active or info.optimizer is None:
            continue
        for part in getattr(info.optimizer, "chained_optimizers", [info.optimizer]):
            if part.grad_scaler is not None:
                states.append({k: float(v) for k, v in part.grad_scaler.state_dict().items()})
    return states


def test_encoder_overflow_backs_off_both_grids_and_steps_stay_in_lockstep(world: int) -> None:
    rank = world
    optimizer, ddp, compute = _build(rank)
    x, g = (t.cuda() for t in _inputs(rank))
    expected_norm = _expected_grad_norm()

    history = []
    for step in range(4):
        # The LLM's loss scale reaches the encoder with the gradient it sends back.
        llm_scale = optimizer.get_loss_scale().detach().float().reshape(1).clone()
        dist.broadcast(llm_scale, src=1)
        inputs = x.clone()
        if step == 0 and rank == 0:
            inputs[0, 0] = float("inf")  # overflow in the encoder grid only
        out = compute(inputs.half())
        (out.float() * g * llm_scale).sum().backward()
        ddp.finish_grad_sync()
        success, grad_norm, _ = optimizer.step()
        states = _scaler_states(optimizer)
        assert len(states) == 1, states
        record = {"success": success, "grad_norm": grad_norm, "scaler": states[0]}
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, record)
        history.append(gathered)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()

    def scaler(scale: float, growth: int, hysteresis: int) -> dict[str, float]:
        return {
            "scale": scale,
            "growth_tracker": float(growth),
            "hysteresis_tracker": float(hysteresis),
        }

    # Step 0: the step is skipped everywhere and both scalers back off (unpatched: [4.0, 8.0]).
    scales = [r["scaler"]["scale"] for r in history[0]]
    assert scales == [4.0, 4.0], f"loss scales [encoder, LLM] after encoder overflow: {scales}"
    assert [r["success"] for r in history[0]] == [False, False]
    assert [r["scaler"] for r in history[0]] == [scaler(4.0, 0, 0)] * 2

    # Clean steps: same flag, scaler state and grad norm on both ranks; the scale grows to 8
    # after loss_scale_window (2) clean steps on both.
    expected_scalers = [scaler(4.0, 1, 0), scaler(8.0, 0, 1), scaler(8.0, 1, 1)]
    for step, expected in enumerate(expected_scalers, start=1):
        ranks = history[step]
        assert [r["success"] for r in ranks] == [True, True], (step, ranks)
        assert [r["scaler"] for r in ranks] == [expected] * 2, (step, ranks)
        norms = [r["grad_norm"] for r in ranks]
        assert norms[0] == norms[1], (step, norms)
        # Each grid unscales by the scale the gradient was scaled with: the true norm.
        assert norms[0] == pytest.approx(expected_norm, rel=1e-3), (step, norms, expected_norm)
