"""Stand-in for Transformer Engine's FusedAdam, shared by tests/multigpu and bench/bench_fsdp.py.

No TE exists on the machines this project runs on. The stand-in follows FusedAdam's
documented contract where Megatron-FSDP depends on it: it reads `param.decoupled_grad` iff
`use_decoupled_grad`, else `param.grad`, and skips params whose gradient there is None.
`te_stand_in()` makes MCore build it where it would build TE's FusedAdam.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

TE_STAND_IN_VERSION = "2.8.0"


class FusedAdamStandIn(torch.optim.Optimizer):
    """Stand-in for TE's FusedAdam, following its documented contract.

    Reads `param.decoupled_grad` iff `use_decoupled_grad`, else `param.grad`, and skips
    parameters whose gradient there is None. Works on the local shard of DTensor parameters.
    Master weights are not modelled: Megatron-FSDP's main weights are FP32 already.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.capturable = capturable
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """Allocate the moments of `param` (TE's precision-aware state initialisation)."""
        local = getattr(param, "_local_tensor", param)
        self.state[param]["exp_avg"] = torch.zeros_like(local, dtype=torch.float32)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(local, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        attr = "decoupled_grad" if self.use_decoupled_grad else "grad"
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = getattr(param, attr, None)
                if grad is None:
                    continue
                grad = getattr(grad, "_local_tensor", grad).float()
                local = getattr(param, "_local_tensor", param)
                state = self.state[param]
                if "exp_avg" not in state:
                    self.initialize_state(param)
                state["step"] = state.get("step", 0) + 1
                if group["weight_decay"] != 0.0:
                    local.mul_(1.0 - group["lr"] * group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                m_hat = state["exp_avg"] / (1.0 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** state["step"])
                local.sub_((group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])).to(local.dtype))


@contextlib.contextmanager
def te_stand_in(te_modules: bool) -> Iterator[None]:
    """Make MCore see FusedAdamStandIn as TE's FusedAdam (TE `TE_STAND_IN_VERSION`).

    `te_modules`: also expose it as `transformer_engine.pytorch.optimizers.FusedAdam`, which
    OptimizerConfig imports to validate `use_precision_aware_optimizer`. Restored on exit.
    """
    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.distrib_optimizer as mcore_distrib_optimizer
    import megatron.core.utils as mcore_utils

    modules: dict[str, types.ModuleType] = {}
    if te_modules:
        te = types.ModuleType("transformer_engine")
        te.__version__ = TE_STAND_IN_VERSION  # type: ignore[attr-defined]
        te_pytorch = types.ModuleType("transformer_engine.pytorch")
        te_optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
        te_optimizers.FusedAdam = FusedAdamStandIn  # type: ignore[attr-defined]
        te.pytorch = te_pytorch  # type: ignore[attr-defined]
        te_pytorch.optimizers = te_optimizers  # type: ignore[attr-defined]
        modules = {module.__name__: module for module in (te, te_pytorch, te_optimizers)}
    saved_modules = {name: sys.modules.get(name) for name in modules}
    patches = [
        (mcore_utils, "_te_version", mcore_utils.PkgVersion(TE_STAND_IN_VERSION)),
        (mcore_optimizer, "Adam", FusedAdamStandIn),
        (mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False),
        (mcore_distrib_optimizer, "Adam", FusedAdamStandIn),
    ]
    saved = [(owner, name, getattr(owner, name, None)) for owner, name, _ in patches]
    sys.modules.update(modules)
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for owner, name, value in saved:
            setattr(owner, name, value)
