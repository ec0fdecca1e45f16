"""Run upstream's unmodified pretrain_gpt.py with observation and injection hooks of ours.

    python bench/e2e_hook.py TREE [pretrain_gpt.py arguments...]

TREE is a Megatron-LM tree (pristine or fork) holding pretrain_gpt.py, gpt_builders.py,
model_provider.py and megatron/. Nothing in megatron/core is replaced; the hooks wrap
megatron/training entry points and the optimizer instance that pretrain() builds:

- E2E_LOG=PATH: one JSON line per training step (rank 0): the step, the loss (float and
  float.hex, for bitwise comparison), skipped, grad norm, and every chained optimizer's
  DynamicGradScaler state (scale, growth_tracker, hysteresis_tracker) after the step.
- E2E_INJECT_STEP=K: before the optimizer step of iteration K, write inf into the main_grad of
  one expert parameter (allreduce=False), i.e. one expert-only overflow.
- E2E_FP32_PARAMS=REGEX: in a pre-wrap hook (upstream's `pre_wrap_hooks` of the model config:
  after the model is built, before Float16Module casts it and DDP wraps it) the params whose
  names match are cast to fp32 and marked keep_in_fp32 (mark_keep_in_fp32), as a model with an
  fp32 norm or router does; they land in the 16-bit optimizer groups. With E2E_FP32_CAST=1 the
  modules owning them compute in fp32 and return their input's dtype (forward hooks), as an
  fp32 norm in a 16-bit model must.
- E2E_EXPERT_PGS=1: in the same hook, mark the expert params (".experts." in the name)
  allreduce=False, as Megatron does at expert-parallel size > 1 (at EP 1 = ETP = TP it treats
  experts as dense params: one optimizer, no chain); the expert data-parallel group they then
  use is the same single rank.
- E2E_FSDP_FLAG_DEFAULT=1: leave DistributedDataParallelConfig.megatron_fsdp_use_decoupled_grad
  at its default (False), as megatron.core users (Bridge, NeMo) do; megatron/training would
  set it from --use-precision-aware-optimizer.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import sys
from typing import Any


def _emit(record: dict[str, Any]) -> None:
    path = os.environ.get("E2E_LOG")
    if not path or int(os.environ.get("RANK", "0")) != 0:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def _scalers(optimizer: Any) -> list[dict[str, float]]:
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    states = []
    for child in children:
        scaler = getattr(child, "grad_scaler", None)
        if scaler is None:
            continue
        states.append(
            {
                "scale": _as_float(scaler.scale),
                "growth": _as_float(getattr(scaler, "growth_tracker", None)),
                "hysteresis": _as_float(getattr(scaler, "hysteresis_tracker", None)),
            }
        )
    return states


def _inject_expert_overflow(model: list[Any]) -> str:
    for chunk in model:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            if not getattr(param, "allreduce", True) and grad is not None:
                grad.view(-1)[0] = math.inf
                return name
    raise RuntimeError("E2E_INJECT_STEP: no expert parameter with a main_grad")


def _compute_in_fp32(module: Any) -> None:
    """Make a module with fp32 params take fp32 input and return its input's dtype."""
    import torch

    def before(mod: Any, args: tuple, kwargs: dict) -> tuple:
        mod._e2e_dtype = args[0].dtype
        return (args[0].float(), *args[1:]), kwargs

    def after(mod: Any, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output.to(mod._e2e_dtype)
        return output

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def _pre_wrap_hook(chunks: list[Any]) -> list[Any]:
    """Upstream's pre-wrap hook point: runs on the built chunks before Float16Module and DDP."""
    pattern = os.environ.get("E2E_FP32_PARAMS")
    if pattern:  # releases before mark_keep_in_fp32 (core_v0.19.0) run scenario 4 without it
        from megatron.core.transformer.module import mark_keep_in_fp32
    expert_pgs = os.environ.get("E2E_EXPERT_PGS") == "1"
    cast = os.environ.get("E2E_FP32_CAST") == "1"
    marked, experts = [], []
    for chunk in chunks:
        for module_name, module in chunk.named_modules():
            owned = False
            for name, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                if pattern and re.search(pattern, full):
                    param.data = param.data.float()
                    mark_keep_in_fp32(param)
                    marked.append(full)
                    owned = True
                if expert_pgs and ".experts." in full:
                    param.allreduce = False
                    experts.append(full)
            if owned and cast:
                _compute_in_fp32(module)
    _emit({"event": "pre_wrap", "fp32_params": marked, "expert_params": experts})
    return chunks


def _install() -> None:
    import megatron.training.training as training

    inject_step = int(os.environ.get("E2E_INJECT_STEP", "0"))
    state: dict[str, Any] = {"step": 0}

    orig_setup = training.setup_model_and_optimizer

    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        container = kwargs.get("cfg_container")
        if container is None or getattr(container, "model", None) is None:
            raise RuntimeError("e2e_hook: pretrain() passed no cfg_container.model")
        container.model.pre_wrap_hooks.append(_pre_wrap_hook)
        model, optimizer, scheduler = orig_setup(*args, **kwargs)
        if optimizer is None:
            return model, optimizer, scheduler
        orig_step = optimizer.step

        def step(*a: Any, **kw: Any) -> Any:
            injected = None
            if state["step"] == inject_step:
                injected = _inject_expert_overflow(model)
            result = orig_step(*a, **kw)
            state["scalers"] = _scalers(optimizer)
            state["injected"] = injected
            return result

        optimizer.step = step
        children = getattr(optimizer, "chained_optimizers", [optimizer])
        _emit({"event": "setup", "chains": [type(c).__name__ for c in children]})
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = setup_model_and_optimizer

    orig_train_step = training.train_step

    def train_step(*args: Any, **kwargs: Any) -> Any:
        state["step"] = int(kwargs.get("iteration") or 0) + 1
        state["scalers"], state["injected"] = [], None
        out = orig_train_step(*args, **kwargs)
        loss_dict, skipped, grad_norm = out[0], out[1], out[5]
        loss = _as_float(loss_dict.get("lm loss")) if loss_dict else None
        _emit(
            {
                "step": state["step"],
                "loss": loss,
                "loss_hex": None if loss is None else float(loss).hex(),
                "skipped": int(skipped),
                "grad_norm": _as_float(grad_norm),
                "scalers": state["scalers"],
                "injected": state["injected"],
            }
        )
        return out

    training.train_step = train_step

    if os.environ.get("E2E_FSDP_FLAG_DEFAULT") == "1":
        orig_ddp_config = training.get_megatron_ddp_config

        def get_megatron_ddp_config(*args: Any, **kwargs: Any) -> Any:
            config = orig_ddp_config(*args, **kwargs)
            if hasattr(config, "megatron_fsdp_use_decoupled_grad"):
                config.megatron_fsdp_use_decoupled_grad = False
            return config

        training.get_megatron_ddp_config = get_megatron_ddp_config


def main() -> None:
    tree = os.path.abspath(sys.argv[1])
    sys.path.insert(0, tree)
    sys.argv = [os.path.join(tree, "pretrain_gpt.py"), *sys.argv[2:]]
    _install()
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
