"""Megatron-FSDP v1 step time of fix 4 (decoupled-grad wiring), patched vs pristine.

Measures a patched and an unpatched (pristine) tree side by side in one run, each in its own
subprocess (so the two `megatron.core` imports never mix), alternating the trees over
`--rounds`:

    python bench/bench_fsdp.py --patched build/trees/main --pristine /tmp/main-pristine
    python bench/bench_fsdp.py ... --steps 50 --rounds 5 --hidden 2048

The tree roots hold `megatron/core` (a pristine tree: `git clone -q build/trees/main X &&
git -C X checkout pristine`). Each worker initialises its own NCCL world of size 1 on GPU 0
and `parallel_state`, wraps a small MLP (hidden -> 4*hidden -> hidden) in Megatron-FSDP v1
(`FullyShardedDataParallel`, optim_grads_params, DDP config left at its defaults otherwise),
builds the optimizer with `get_megatron_optimizer` (adam, use_precision_aware_optimizer=True,
clip_grad set) and times full training steps (zero_grad, forward, backward,
finish_grad_sync, optimizer.step), each between two `torch.cuda.synchronize()`.

Transformer Engine is not required: as in the regression test of the fix, MCore builds a
stand-in that follows the contract of TE's FusedAdam (reads `param.decoupled_grad` iff its
`use_decoupled_grad` is set, else `param.grad`; skips parameters whose gradient there is None),
and `clip_grads` uses a stand-in for TE's multi-tensor applier and its l2norm / scale /
scale_tensor kernels. TE's kernels dereference element 0 of each tensor list, so an empty list
is a segfault with TE; the stand-in counts such calls and skips them. Unpatched, Megatron-FSDP
installs gradients into `param.grad` while the optimizer reads `param.decoupled_grad`: the
grad norm is 0, clipping hits the empty-list path and no weight changes, so the pristine step
is cheaper only because it trains nothing. Only the stdlib and torch are needed (plus what the
trees' `megatron.core` imports); a machine without CUDA gets a message and exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

# The FusedAdam stand-in is shared with the 2-GPU test (tests/multigpu/te_standin.py).
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "multigpu")
)
from te_standin import te_stand_in  # noqa: E402

TREES = ("patched", "pristine")


# --- worker side (runs with one tree first on sys.path) ------------------------------------


class MultiTensorStandIn:
    """Stand-in for TE's multi_tensor_applier and its l2norm / scale / scale_tensor kernels.

    An empty tensor list (a segfault with TE) is counted and skipped.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.empty_calls = 0

    def applier(self, op: Any, noop_flag: torch.Tensor, tensor_lists: list, *args: Any) -> Any:
        """Apply `op` to `tensor_lists`, as TE's applier launches its kernel."""
        if any(len(tensor_list) == 0 for tensor_list in tensor_lists):
            self.empty_calls += 1
            return torch.zeros(1, device="cuda"), None
        self.calls += 1
        return op(noop_flag, tensor_lists, *args)

    @staticmethod
    def l2norm(noop_flag: torch.Tensor, tensor_lists: list, per_tensor: bool) -> Any:
        """L2 norm over all tensors of the first list, as a 1-element tensor."""
        norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensor_lists[0]])
        return torch.linalg.vector_norm(norms).reshape(1), None

    @staticmethod
    def scale(noop_flag: torch.Tensor, tensor_lists: list, scale: Any) -> None:
        """dst = src * scale (scale: a float or a 1-element tensor)."""
        for src, dst in zip(tensor_lists[0], tensor_lists[1], strict=True):
            dst.copy_(src * scale)

    def install(self) -> None:
        """Make `megatron.core.optimizer.clip_grads` use this stand-in where it would use TE."""
        from megatron.core.optimizer import clip_grads

        clip_grads.multi_tensor_applier = self.applier
        clip_grads.l2_norm_impl = self.l2norm
        clip_grads.multi_tensor_scale_impl = self.scale
        clip_grads.multi_tensor_scale_tensor_impl = self.scale


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(tree: str, steps: int, warmup: int, hidden: int, clip_grad: float) -> dict[str, Any]:
    """In a child process: time `steps` training steps after `warmup` on `tree`."""
    sys.path.insert(0, os.path.abspath(tree))
    import logging
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()
    kernels = MultiTensorStandIn()
    kernels.install()
    try:
        torch.manual_seed(1234)
        module = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(4 * hidden, hidden),
        ).cuda()
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            use_distributed_optimizer=True,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        )
        model = FullyShardedDataParallel(
            config=TransformerConfig(num_attention_heads=1, num_layers=1, hidden_size=hidden),
            ddp_config=ddp_config,
            module=module,
            fsdp_unit_modules=[torch.nn.Linear],
        )
        with te_stand_in(te_modules=True):
            config = OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                weight_decay=0.0,
                use_distributed_optimizer=True,
                use_precision_aware_optimizer=True,
                clip_grad=clip_grad,
            )
        with te_stand_in(te_modules=False):
            optimizer = get_megatron_optimizer(config, [model], use_gloo_process_groups=False)

        main_weights = list(optimizer.get_parameters())
        before = [getattr(p, "_local_tensor", p).detach().clone() for p in main_weights]
        inputs = torch.randn(8, hidden, device="cuda")
        times_ms: list[float] = []
        grad_norm: Any = None
        empty_calls = 0
        for step in range(warmup + steps):
            empty_before = kernels.empty_calls
            torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            model.finish_grad_sync()
            _, grad_norm, _ = optimizer.step()
            torch.cuda.synchronize()
            if step >= warmup:
                times_ms.append((time.perf_counter() - start) * 1e3)
                empty_calls += kernels.empty_calls - empty_before
        if hasattr(model, "stop_communication"):
            model.stop_communication()
        after = [getattr(p, "_local_tensor", p) for p in main_weights]
        buffer = model.param_and_grad_buffer
        fsdp_writes_decoupled = getattr(
            buffer, "use_decoupled_grad", getattr(buffer, "use_precision_aware_optimizer", False)
        )
        return dict(
            megatron_core=os.path.dirname(megatron.core.__file__),
            times_ms=times_ms,
            grad_norm=None if grad_norm is None else float(grad_norm),
            weights_changed=any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)),
            empty_calls=empty_calls,
            kernel_calls=kernels.calls,
            adam_reads="decoupled_grad" if optimizer.optimizer.use_decoupled_grad else "grad",
            fsdp_writes="decoupled_grad" if fsdp_writes_decoupled else "grad",
        )
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# --- driver side ---------------------------------------------------------------------------


def run_child(tree: str, args: argparse.Namespace) -> dict[str, Any]:
    """Measure `tree` in a fresh interpreter; on failure, a dict with `error`."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--hidden", str(args.hidden), "--clip-grad", str(args.clip_grad)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        return dict(error=f"exit status {proc.returncode}\n{tail}")
    return json.loads(lines[-1])


def fmt_norm(value: float | None) -> str:
    return "None" if value is None else f"{value:.4g}"


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> bool:
    """Print the table; False if a tree failed."""
    print(
        f"Megatron-FSDP v1, world size 1 (NCCL), MLP {args.hidden}-{4 * args.hidden}-"
        f"{args.hidden}, FusedAdam-contract stand-in, use_precision_aware_optimizer=True, "
        f"clip_grad={args.clip_grad}; {args.rounds} rounds x {args.steps} steps "
        f"(+{args.warmup} warm-up), trees alternating"
    )
    header = (
        f"{'tree':<9} {'median ms':>10} {'min ms':>8} {'grad norm':>10} {'weights':>8} "
        f"{'empty-list':>10} {'adam reads':>15} {'fsdp writes':>15}"
    )
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    ok = True
    for tree in TREES:
        runs = results[tree]
        errors = [run["error"] for run in runs if "error" in run]
        if errors:
            ok = False
            print(f"{tree:<9} FAILED in {len(errors)} of {len(runs)} rounds:\n{errors[-1]}")
            continue
        times = [t for run in runs for t in run["times_ms"]]
        medians[tree] = statistics.median(times)
        last = runs[-1]
        print(
            f"{tree:<9} {medians[tree]:>10.3f} {min(times):>8.3f} "
            f"{fmt_norm(last['grad_norm']):>10} "
            f"{'changed' if all(r['weights_changed'] for r in runs) else 'FROZEN':>8} "
            f"{sum(r['empty_calls'] for r in runs):>10} "
            f"{last['adam_reads']:>15} {last['fsdp_writes']:>15}"
        )
    if len(medians) == len(TREES):
        ratio = medians["patched"] / medians["pristine"]
        print(f"patched/unpatched median step time: {ratio:.3f}")
    print(
        "grad norm: of the last step; weights: main weights after all steps of each round vs "
        "before; empty-list: multi_tensor_applier calls with an empty tensor list over the "
        "timed steps of all rounds (a segfault with TE). Unpatched trains nothing, so its "
        "step skips the optimizer update."
    )
    for tree in TREES:
        sources = {run.get("megatron_core") for run in results[tree] if "error" not in run}
        print(f"{tree}: megatron.core from {', '.join(sorted(s for s in sources if s))}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patched", help="tree (holding megatron/core) with the patch")
    parser.add_argument("--pristine", help="tree (holding megatron/core) without the patch")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the trees alternate")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP hidden size")
    parser.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--clip-grad", type=float, default=1e-3, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = measure(args.child, args.steps, args.warmup, args.hidden, args.clip_grad)
        print(json.dumps(result))
        return 0
    if not args.patched or not args.pristine:
        parser.error("--patched and --pristine are required")
    for tree in (args.patched, args.pristine):
        if not os.path.isdir(os.path.join(tree, "megatron", "core")):
            parser.error(f"{tree} holds no megatron/core")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    if not torch.cuda.is_available():
        print("bench_fsdp: CUDA is not available; Megatron-FSDP needs a GPU. Nothing measured.")
        return 0

    roots = {"patched": args.patched, "pristine": args.pristine}
    results: dict[str, list[dict[str, Any]]] = {tree: [] for tree in TREES}
    for round_index in range(args.rounds):
        order = TREES if round_index % 2 == 0 else TREES[::-1]
        for tree in order:
            results[tree].append(run_child(roots[tree], args))
    return 0 if report(args, results) else 1


if __name__ == "__main__":
    sys.exit(main())
