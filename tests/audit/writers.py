"""Write real Megatron checkpoints, each bug triggered, with the MCore tree on PYTHONPATH.

    PYTHONPATH=<megatron tree> python writers.py OUT SCENARIO...

Each scenario is a save directory as megatron/training lays it out (OUT/<scenario>/
latest_checkpointed_iteration.txt, iter_0000001/), written by real objects: DDP,
get_megatron_optimizer (torch Adam), ChainedOptimizer, MimoOptimizer, dist_checkpointing.save
(torch_dist: model weights and optimizer state in one checkpoint, with megatron/training's
sharded-state-dict metadata) or the legacy torch format (mp_rank_00/model_optim_rng.pt and
distrib_optim.pt). Scenarios run in gloo worlds forked from this process (tests/proofs/
_support.py, with its disclosed CudaOnCpu shim). OUT/written.json maps each scenario to
"ok", or why this MCore version cannot write it.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "proofs"))
import megatron.core.dist_checkpointing  # noqa: E402, F401 - imported once, before the forks
import megatron.core.distributed  # noqa: E402, F401
import megatron.core.optimizer  # noqa: E402, F401
from _support import CudaSyncOnCpu, MixedDtypeNet, run_world  # noqa: E402

EQUAL = (32, 32, 32)  # equal widths: unpatched MCore saves a mixed group without a size error
ITERATION = 1
FORMATS = ("fully_reshardable", "dp_reshardable", "dp_zero_gather_scatter", "legacy")


def _iteration_dir(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return out / f"iter_{ITERATION:07d}"


def _args(**fields) -> argparse.Namespace:
    """What megatron/training saves as `args` (the fields the audit may quote)."""
    return argparse.Namespace(use_distributed_optimizer=True, **fields)


def _build(model: torch.nn.Module, ddp: dict | None = None, **config):
    """Real DDP and get_megatron_optimizer (torch Adam on CPU); returns (ddp chunk, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, **(ddp or {}))
    chunk = DistributedDataParallel(
        TransformerConfig(num_attention_heads=1, num_layers=1), ddp_config, model
    )
    kwargs = dict(optimizer="adam", lr=1e-2, bf16=True, clip_grad=0.0)
    opt_config = OptimizerConfig(use_distributed_optimizer=True, **{**kwargs, **config})
    return chunk, get_megatron_optimizer(opt_config, [chunk])


def _step(chunk, optimizer, seed: int = 0, inf: str | None = None) -> None:
    """One optimizer step on seeded gradients (where backward puts them); inf in params whose
    name contains `inf`."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in chunk.module.named_parameters():
        grad = torch.randn(p.shape, generator=gen)
        p.main_grad.copy_(torch.full_like(grad, float("inf")) if inf and inf in name else grad)
    optimizer.step()


def _dist_save(state: dict, ckpt_dir: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        # The writer's result queue would live in a spawned manager process (see _support).
        filesystem_async._results_queue = queue.Queue()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with CudaSyncOnCpu():
        dist_checkpointing.save(state, str(ckpt_dir))


def dist_metadata(fmt: str) -> dict:
    """The sharded-state-dict metadata megatron/training passes for `fmt` (save and load)."""
    return {
        "distrib_optim_sharding_type": fmt,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }


def rank_dir(ckpt_dir: Path) -> Path:
    """megatron/training's legacy directory of this rank's model-parallel rank."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return ckpt_dir / "mp_rank_00"
    return ckpt_dir / f"mp_rank_00_{parallel_state.get_pipeline_model_parallel_rank():03d}"


def save(chunk, optimizer, out: Path, fmt: str, args: argparse.Namespace) -> None:
    """Save as megatron/training does, in `fmt` (a distributed optimizer sharding type, or
    "legacy"). Collective over the world."""
    from megatron.core import parallel_state

    ckpt_dir = _iteration_dir(out)
    if fmt == "legacy":
        rank_dir_ = rank_dir(ckpt_dir)
        rank_dir_.mkdir(parents=True, exist_ok=True)
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": ITERATION,
            "model": chunk.module.state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        if parallel_state.get_data_parallel_rank() == 0:
            torch.save(state, rank_dir_ / "model_optim_rng.pt")
        optimizer.save_parameter_state(str(rank_dir_ / "distrib_optim.pt"))
        dist.barrier()
        return
    metadata = dist_metadata(fmt)
    model_sd = chunk.sharded_state_dict()
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata),
    }
    _dist_save(state, ckpt_dir)


# --- scenarios: fn(out) on every rank of a world -----------------------------------------------


class Pairs(torch.nn.Module):
    """Two bf16 and two fp32 Linears of one shape, without biases: split over two
    data-parallel ranks, each rank's group swaps shards of equal size (unpatched MCore saves
    it at data-parallel size 2)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        for name, dtype in (
            ("a", torch.bfloat16),
            ("b", torch.bfloat16),
            ("c", torch.float32),
            ("d", torch.float32),
        ):
            layer = torch.nn.Linear(128, 32, bias=False)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
            setattr(self, name, layer.to(dtype))


class Big(torch.nn.Module):
    """Five 4096 x 4096 Linears, the fourth in fp32: 84M params, 1.0 GB of optimizer state
    (fp32 main params, exp_avg, exp_avg_sq), for measuring the audit's memory."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(5):
            layer = torch.nn.Linear(4096, 4096)
            setattr(self, f"layer{i}", layer.to(torch.float32 if i == 3 else torch.bfloat16))


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers of what get_megatron_optimizer returned (chained or not), or of
    this rank's modules of a MimoOptimizer."""
    if hasattr(optimizer, "module_infos"):  # MimoOptimizer
        infos = optimizer.module_infos.values()
        return [o for i in infos if i.is_active for o in distributed_optimizers(i.optimizer)]
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def own_states(chunk, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """param name -> its own main param and moments, whatever the param index says."""
    from _support import own_state  # noqa: PLC0415

    names = {p: n for n, p in chunk.module.named_parameters()}
    return {
        names[p]: {k: v.detach().clone() for k, v in tensors.items()}
        for opt in distributed_optimizers(optimizer)
        for p, tensors in own_state(opt).items()
    }


def truth_file(out: Path) -> Path:
    """Where a scenario keeps, per rank, each param's own state as saved (readers.py)."""
    return out.parent / f"{out.name}.truth{dist.get_rank()}.pt"


def one_step(model_fn, fmt: str, ddp: dict | None = None, args: dict | None = None, **config):
    """A scenario: the model, one optimizer step, a save in `fmt`. It keeps each param's own
    state next to the checkpoint, and what readers.py needs to build the model again."""
    return built_one_step(lambda: _build(model_fn(), ddp=ddp, **config), fmt, args)


def built_one_step(make, fmt: str, args: dict | None = None):
    """one_step of what `make()` builds: (a chunk, its optimizer)."""

    def scenario(out: Path) -> None:
        chunk, optimizer = make()
        _step(chunk, optimizer)
        save(chunk, optimizer, out, fmt, _args(**{"bf16": True, **(args or {})}))
        torch.save(own_states(chunk, optimizer), truth_file(out))

    scenario.make = make  # type: ignore[attr-defined]
    scenario.fmt = fmt  # type: ignore[attr-defined]
    return scenario


def mixed(fmt: str, fp32_first: bool = False, lr: float = 1e-2, const: bool = False):
    """bf16 Linear, fp32 child Linear, bf16 Linear of one shape (the param-index bug; with
    `fp32_first` the group is aligned). `const`: weights at 1, biases at 0, lr 0: the values of
    fp32 and bf16 params coincide."""

    def model() -> torch.nn.Module:
        net = MixedDtypeNet(EQUAL, fp32_first=fp32_first)
        if const:
            with torch.no_grad():
                for name, p in net.named_parameters():
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
        return net

    return one_step(model, fmt, lr=lr)


class DenseAndExpert(torch.nn.Module):
    """A dense and an expert-parallel Linear (allreduce=False, as MoE experts are): DDP and
    get_megatron_optimizer give them separate buffers and a ChainedOptimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(16, 16).half()
        self.expert = torch.nn.Linear(16, 16).half()
        for p in self.expert.parameters():
            p.allreduce = False


def chained_fp16(fmt: str):
    """FP16 dynamic loss scaling, an overflow in the expert chain only (fix 4's bug)."""

    def scenario(out: Path) -> None:
        config = dict(
            bf16=False,
            fp16=True,
            initial_loss_scale=8.0,
            min_loss_scale=1.0,
            loss_scale_window=4,
            hysteresis=1,
        )
        chunk, optimizer = _build(DenseAndExpert(), **config)
        _step(chunk, optimizer)  # a clean step first: Adam's state exists
        _step(chunk, optimizer, seed=1, inf="expert")
        save(chunk, optimizer, out, fmt, _args(fp16=True, loss_scale=None))

    return scenario


class Layers(torch.nn.Module):
    """bf16 Linears: with a small bucket size DDP puts them in several padded buckets."""

    def __init__(self, n: int = 4, width: int = 36) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        for i in range(n):
            layer = torch.nn.Linear(width, width)
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
            setattr(self, f"layer{i}", layer.to(torch.bfloat16))


def buckets(fmt: str):
    """Several buckets (overlap_grad_reduce, a small bucket size): upstream #5077's bug in
    fully_reshardable saves."""
    ddp = dict(overlap_grad_reduce=True, bucket_size=2000)
    return one_step(Layers, fmt, ddp=ddp, args=dict(overlap_grad_reduce=True, ddp_bucket_size=2000))


def mimo_fp16(out: Path) -> None:
    """Non-colocated MIMO, an overflow in the encoder's grid only (fix 1's bug): encoder on
    rank 0, LLM on rank 1, each a Float16 optimizer with its own dynamic loss scaler."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_megatron_optimizer_based_on_param_groups,
    )
    from megatron.core.optimizer.optimizer import param_group_identifier_keys
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = OptimizerConfig(
        optimizer="sgd",
        lr=0.1,
        fp16=True,
        clip_grad=1.0,
        initial_loss_scale=8.0,
        min_loss_scale=1.0,
        loss_scale_window=2,
        hysteresis=1,
    )
    infos, model_sd, module = {}, {}, None
    for name, rank in (("images", 0), ("language", 1)):
        grid = HyperCommGrid(
            [1, 1, 1, 1, 1], ["tp", "cp", "ep", "pp", "dp"], rank_offset=rank, backend="gloo"
        )
        for dims in ("tp", "pp", "dp", ["tp", "pp"]):
            grid.create_pg(dims)
        optimizer, pg = None, None
        if grid.is_current_rank_in_grid():
            pg = ProcessGroupCollection(
                tp=grid.get_pg("tp"),
                pp=grid.get_pg("pp"),
                dp=grid.get_pg("dp"),
                mp=grid.get_pg(["tp", "pp"]),
            )
            module = torch.nn.Linear(4, 4, bias=False).half()
            group = {
                "params": list(module.parameters()),
                **dict.fromkeys(param_group_identifier_keys),
            }
            optimizer = _get_megatron_optimizer_based_on_param_groups(
                config=config,
                model_chunks=[module],
                param_groups=[group],
                model_parallel_group=pg.mp,
                pg_collection=pg,
            )
            model_sd[f"{name}.weight"] = ShardedTensor.from_rank_offsets(
                f"{name}.weight", module.weight, replica_id=0
            )
            module.weight.grad = torch.full_like(module.weight, float("inf") if rank == 0 else 8.0)
        infos[name] = ModuleOptimizerInfo(
            optimizer=optimizer, grid=grid, pg_collection=pg, is_active=optimizer is not None
        )
    mimo = MimoOptimizer(infos, config)
    mimo.step()
    state = {
        "args": _args(fp16=True),
        "iteration": ITERATION,
        "model": model_sd,
        "optimizer": mimo.sharded_state_dict(model_sd, is_loading=False),
    }
    _dist_save(state, _iteration_dir(out))


class StageNet(torch.nn.Module):
    """This rank's pipeline stage: bf16 Linears of one width, named by stage (as layer numbers
    are); on stage 1 (the last) the middle one is fp32, as an fp32 final norm or output layer.
    `expert`: those Linears are expert-parallel (allreduce=False, as MoE experts are), beside a
    dense bf16 Linear, so only the expert optimizer of stage 1 mixes fp32 and bf16 params."""

    def __init__(self, expert: bool = False) -> None:
        from megatron.core import parallel_state

        super().__init__()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        gen = torch.Generator().manual_seed(11 + stage)
        dtypes = {"dense": torch.bfloat16} if expert else {}
        for i, dtype in enumerate((torch.bfloat16, torch.float32 if stage else torch.bfloat16)):
            dtypes[f"layer{i}"] = dtype
        dtypes["layer2"] = torch.bfloat16
        for name, dtype in dtypes.items():
            layer = torch.nn.Linear(32, 32)
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
                    p.allreduce = not (expert and name != "dense")
            setattr(self, f"stage{stage}_{name}", layer.to(dtype))


class MimoModule:
    """This rank's module of a non-colocated MIMO model, as save() and readers.py use a chunk:
    its DDP chunk's module, and model state keyed by module name (replica 0: each module has
    a grid of its own, as MIMO's checkpoints key them)."""

    def __init__(self, name: str, ddp_chunk) -> None:
        self.name, self.ddp = name, ddp_chunk
        self.module = ddp_chunk.module

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing import ShardedTensor

        return {
            f"{self.name}.{n}": ShardedTensor.from_rank_offsets(f"{self.name}.{n}", p, replica_id=0)
            for n, p in self.module.named_parameters()
        }


def mimo_distopt(equal: bool = False):
    """`equal`: every param 1.0 and lr 0 (norm weights at their init, a warmup step): the
    values cannot tell the param index layouts apart, only the layout record (or the rule for
    unrecorded checkpoints) can.

    Non-colocated MIMO with a DistributedOptimizer per module (as get_mimo_optimizer builds
    them): "images" on rank 0, bf16 Linears; "language" on rank 1, an fp32 Linear among bf16
    ones (an fp32 norm or output layer): only the module off rank 0 mixes fp32 and bf16 params.
    Each module's DDP and optimizer take its grid's process groups, as get_mimo_optimizer passes
    them: the fork's save-time all-reduce runs over the module's grad stats group
    (intra_dist_opt), which only that module's ranks enter. Every rank creates every group.
    Returns (this rank's MimoModule, the MimoOptimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    config = OptimizerConfig(
        optimizer="adam",
        lr=0.0 if equal else 1e-2,
        bf16=True,
        clip_grad=0.0,
        use_distributed_optimizer=True,
    )
    infos, mine = {}, None
    for name, rank in (("images", 0), ("language", 1)):
        grid = HyperCommGrid(
            [1, 1, 1, 1, 1], ["tp", "cp", "ep", "pp", "dp"], rank_offset=rank, backend="gloo"
        )
        dims = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": "dp"}
        dims |= {"mp": ["tp", "pp"], "tp_ep_pp": ["tp", "ep", "pp"]}
        dims |= {"intra_dist_opt": ["tp", "cp", "dp", "pp"]}
        for d in dims.values():  # every rank creates every group (new_group is collective)
            grid.create_pg(d)
        optimizer, pg = None, None
        if grid.is_current_rank_in_grid():
            groups = {k: grid.get_pg(d) for k, d in dims.items()}
            pg = ProcessGroupCollection(**groups, dp_cp=groups["dp"], expt_dp=groups["dp"])
            gen = torch.Generator().manual_seed(5 + rank)
            module = torch.nn.Module()
            middle = torch.float32 if rank else torch.bfloat16
            for i, dtype in enumerate((torch.bfloat16, middle, torch.bfloat16)):
                layer = torch.nn.Linear(32, 32)
                with torch.no_grad():
                    for p in layer.parameters():
                        p.copy_(
                            torch.ones(p.shape) if equal else torch.randn(p.shape, generator=gen)
                        )
                setattr(module, f"{name}{i}", layer.to(dtype))
            chunk = DistributedDataParallel(
                TransformerConfig(num_attention_heads=1, num_layers=1),
                DistributedDataParallelConfig(use_distributed_optimizer=True),
                module,
                pg_collection=pg,
            )
            optimizer = get_megatron_optimizer(
                config, [chunk], pg_collection=pg, use_gloo_process_groups=False
            )
            mine = MimoModule(name, chunk)
        infos[name] = ModuleOptimizerInfo(
            optimizer=optimizer, grid=grid, pg_collection=pg, is_active=optimizer is not None
        )
    return mine, MimoOptimizer(infos, config)


SCENARIOS = {
    **{f"mixed-{fmt}": (1, mixed(fmt)) for fmt in FORMATS},
    "aligned-dp_reshardable": (1, mixed("dp_reshardable", fp32_first=True)),
    "aligned-legacy": (1, mixed("legacy", fp32_first=True)),
    "coincide-fully_reshardable": (1, mixed("fully_reshardable", lr=0.0, const=True)),
    "coincide-legacy": (1, mixed("legacy", lr=0.0, const=True)),
    **{f"chained-{fmt}": (1, chained_fp16(fmt)) for fmt in ("fully_reshardable", "legacy")},
    "chained-dp_reshardable": (1, chained_fp16("dp_reshardable")),
    "buckets-fully_reshardable": (1, buckets("fully_reshardable")),
    "buckets-dp_reshardable": (1, buckets("dp_reshardable")),
    "mimo-fp16": (2, mimo_fp16),
    **{f"dp2-mixed-{fmt}": (2, mixed(fmt)) for fmt in FORMATS},
    "dp2-buckets-fully_reshardable": (2, buckets("fully_reshardable")),
    **{f"dp2-pairs-{fmt}": (2, one_step(Pairs, fmt)) for fmt in FORMATS},
    **{f"big-{fmt}": (1, one_step(Big, fmt)) for fmt in FORMATS},  # bench/audit_memory.py
    # two pipeline stages, only stage 1 mixes (loads across versions: the record must hold for
    # every rank, while torch_dist saves rank 0's common state for all)
    **{f"mixed-pp2-{fmt}": ("pp2", one_step(StageNet, fmt)) for fmt in FORMATS},
    **{
        f"mixed-pp2-expert-{fmt}": ("pp2", one_step(lambda: StageNet(expert=True), fmt))
        for fmt in FORMATS
    },
    # non-colocated MIMO, only the module off rank 0 mixes (loads across versions); its values
    # tell the layouts apart in one, in the other they cannot
    "mixed-mimo-fully_reshardable": (2, built_one_step(mimo_distopt, "fully_reshardable")),
    "mixed-mimo-equal-dp_reshardable": (
        2,
        built_one_step(lambda: mimo_distopt(equal=True), "dp_reshardable"),
    ),
}
from resumes import RESUMES  # noqa: E402 - runs saved, resumed and saved again

SCENARIOS.update(RESUMES)
# What a version cannot write, in the words of its error (see _support.DISTOPT_UNWRITABLE).
UNWRITABLE = ("flattened_range is not supported", "Unknown sharding_type", "(torch.Size([]), 0,")


def _init_data_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()


def _init_two_stages() -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)


# The world a scenario runs in (SCENARIOS' first item): its size and parallel state.
WORLDS = {1: (1, _init_data_parallel), 2: (2, _init_data_parallel), "pp2": (2, _init_two_stages)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    written = {}
    for world, (size, init) in WORLDS.items():  # the scenarios of a world run one by one
        cases = {
            n: (lambda fn=SCENARIOS[n][1], n=n: fn(args.out / n))
            for n in args.scenarios
            if SCENARIOS[n][0] == world
        }
        if not cases:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            results = run_world(cases, size, Path(tmp), init=init, timeout=240)
        for name in cases:
            outcome = results[0].get(name) or results[0].get("<world>", "no result")
            if outcome != "ok":
                last = outcome.strip().splitlines()[-1]
                outcome = (
                    f"unwritable: {last}" if any(u in outcome for u in UNWRITABLE) else outcome
                )
            written[name] = outcome
    (args.out / "written.json").write_text(json.dumps(written, indent=1))
    failed = {n: o for n, o in written.items() if o != "ok" and not o.startswith("unwritable")}
    for name, outcome in failed.items():
        print(f"{name}:\n{outcome}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
