"""writers.py's scenarios of runs saved, resumed and saved again: the bugs a resume shows.

Each run trains with the optimizer param scheduler megatron/training builds from its args
(cosine decay, constant weight decay), saves iteration 1 with the scheduler's state, is
resumed by fresh objects from that checkpoint (model, optimizer, scheduler, in that order) and
saves iteration 2: the checkpoint the audit reads.

- decoupled-*: `--decoupled-lr` (upstream #4705): the embedding's groups differ from the
  others in max_lr/min_lr only; a resume without #4705 pairs saved and current groups by keys
  that do not hold them, and the second save carries other groups' bounds.
- override-*: `--override-opt-param-scheduler` with a new `--lr` (upstream #5213): the
  scheduler takes the new bounds, the param groups keep the saved ones.
- fsdp-step: Megatron-FSDP's `fully_shard(model, optimizer)` (upstream #5976): an optimizer
  step before training, so Adam's step count is one ahead of the iterations.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

TRACKER = "latest_checkpointed_iteration.txt"
LR, MIN_LR, DECOUPLED_LR, DECOUPLED_MIN_LR, WD = 1e-2, 1e-3, 5e-3, 5e-4, 0.1


class Embedded(torch.nn.Module):
    """An embedding-like Linear (is_embedding_or_output_parameter: --decoupled-lr's params)
    and a hidden one, bf16: four groups (decoupled or not, weight decay or not)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(4705)
        for name in ("embedding", "hidden"):
            layer = torch.nn.Linear(16, 16)
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
            setattr(self, name, layer.to(torch.bfloat16))
        for p in self.embedding.parameters():
            p.is_embedding_or_output_parameter = True


def _build(distributed: bool, config: dict):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    chunk = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1), ddp_config, Embedded()
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            bf16=True,
            clip_grad=0.0,
            weight_decay=WD,
            use_distributed_optimizer=distributed,
            **{k: v for k, v in config.items() if k != "override"},
        ),
        [chunk],
    )
    override = config.get("override", False)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config["lr"],
        min_lr=config["min_lr"],
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="cosine",
        start_wd=WD,
        end_wd=WD,
        wd_incr_steps=100,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not override,
        override_opt_param_scheduler=override,
    )
    return chunk, optimizer, scheduler


def _args(distributed: bool, config: dict, start: int) -> argparse.Namespace:
    """The fields megatron/training saves as `args` that the audit reads; `iteration` is the
    one the run started from (megatron/training sets it on load, 0 for a new run)."""
    return argparse.Namespace(
        iteration=start,
        use_distributed_optimizer=distributed,
        bf16=True,
        lr=config["lr"],
        min_lr=config["min_lr"],
        decoupled_lr=config.get("decoupled_lr"),
        decoupled_min_lr=config.get("decoupled_min_lr"),
        weight_decay=WD,
        start_weight_decay=WD,
        end_weight_decay=WD,
        weight_decay_incr_style="constant",
        lr_decay_style="cosine",
        override_opt_param_scheduler=config.get("override", False),
        use_checkpoint_opt_param_scheduler=not config.get("override", False),
    )


def _save(objects, out: Path, fmt: str, n: int, args: argparse.Namespace) -> None:
    from writers import _dist_save, dist_metadata

    chunk, optimizer, scheduler = objects
    ckpt = out / f"iter_{n:07d}"
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": n,
        "opt_param_scheduler": scheduler.state_dict(),
    }
    if fmt == "legacy":
        (ckpt / "mp_rank_00").mkdir(parents=True, exist_ok=True)
        state.update(model=chunk.module.state_dict(), optimizer=optimizer.state_dict())
        torch.save(state, ckpt / "mp_rank_00" / "model_optim_rng.pt")
    else:
        model_sd = chunk.sharded_state_dict()
        state["model"] = model_sd
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata=dist_metadata(fmt)
        )
        _dist_save(state, ckpt)
    (out / TRACKER).write_text(str(n))


def _load(objects, out: Path, fmt: str, n: int) -> None:
    """As megatron/training's load_checkpoint: model weights, optimizer, scheduler."""
    from megatron.core import dist_checkpointing
    from writers import dist_metadata

    chunk, optimizer, scheduler = objects
    ckpt = out / f"iter_{n:07d}"
    if fmt == "legacy":
        state = torch.load(ckpt / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        chunk.module.load_state_dict(state["model"])
    else:
        model_sd = chunk.sharded_state_dict()
        request = {
            "model": model_sd,
            "optimizer": optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=dist_metadata(fmt)
            ),
        }
        state = dist_checkpointing.load(request, str(ckpt))
        with torch.no_grad():
            for key, sharded in model_sd.items():
                sharded.data.copy_(state["model"][key])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])


def _train(objects, seed: int) -> None:
    chunk, optimizer, scheduler = objects
    gen = torch.Generator().manual_seed(seed)
    for p in chunk.module.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    optimizer.step()
    scheduler.step(increment=1)


def resumed(fmt: str, first: dict, second: dict | None = None, distributed: bool = True):
    """A scenario: iteration 1 trained with `first`, saved; resumed with `second` (the same
    by default), iteration 2 trained and saved."""

    def scenario(out: Path) -> None:
        from _support import CudaSyncOnCpu

        for n, config in ((1, first), (2, second or first)):
            objects = _build(distributed, config)
            if n > 1:
                objects[1].step()  # optimizer state to load into (as tests/audit/readers.py)
                with CudaSyncOnCpu():
                    _load(objects, out, fmt, n - 1)
            _train(objects, seed=n)
            _save(objects, out, fmt, n, _args(distributed, config, n - 1))

    return scenario


class FsdpUnit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5976)
        self.weight = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
        self.bias = torch.nn.Parameter(torch.randn(8, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def fsdp_step(out: Path, iterations: int = 2) -> None:
    """Megatron-FSDP's fully_shard(model, optimizer) with torch AdamW, trained `iterations`
    steps and saved with torch.distributed.checkpoint as the fsdp_dtensor format does (model
    and optimizer state dicts, iteration, args)."""
    import torch.distributed.checkpoint as dcp
    from _support import CudaStreamsOnCpu
    from megatron.core.distributed.fsdp.src.megatron_fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    module = FsdpUnit()
    with CudaStreamsOnCpu():
        model, optimizer = fully_shard(
            module,
            torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD),
            device_mesh=mesh,
            dp_shard_dim="dp",
            tp_dim="tp",
            fsdp_unit_modules=[FsdpUnit],
            device=torch.device("cpu"),
        )
        for _ in range(iterations):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.ones_like(p)
            optimizer.step(sync_grad_before_optimizer_step=False)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iteration": iterations,
            "args": argparse.Namespace(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor", lr=LR),
        }
        dcp.save(state, checkpoint_id=str(out / f"iter_{iterations:07d}"))
    (out / TRACKER).write_text(str(iterations))


DECOUPLED = dict(lr=LR, min_lr=MIN_LR, decoupled_lr=DECOUPLED_LR, decoupled_min_lr=DECOUPLED_MIN_LR)
PLAIN = dict(lr=LR, min_lr=MIN_LR)
OVERRIDE = dict(lr=2 * LR, min_lr=2 * MIN_LR, override=True)

RESUMES = {
    "decoupled-dp_reshardable": (1, resumed("dp_reshardable", DECOUPLED)),
    "decoupled-legacy-bf16": (1, resumed("legacy", DECOUPLED, distributed=False)),
    "override-dp_reshardable": (1, resumed("dp_reshardable", PLAIN, OVERRIDE)),
    "plain-dp_reshardable": (1, resumed("dp_reshardable", PLAIN)),
    "fsdp-step": (1, fsdp_step),
}
