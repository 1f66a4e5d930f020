"""An Adam or AdamW step as a plain function of tensors, so that precompile can save it too.

`torch.compile(opt.step)` works, but `opt.step` cannot be `aot_compile`d: the optimizer's
`_use_grad` decorator breaks the graph on purpose, and its state is reached through the optimizer
object, which Dynamo guards by identity (not savable). A first step loaded from precompiled files
would then still wait for Dynamo to trace the optimizer (about a third of a small model's warm start).

`OptimizerStep` splits the step where torch's own code does: `arguments()` runs the optimizer's
`_init_group` eagerly (the lazy state initialisation and the lists of parameters with gradients,
exactly as `opt.step` gathers them), and `function` is the update math over those lists (torch's
functional `adam`), under `no_grad`, with every hyperparameter passed in, so Dynamo traces it with
`fullgraph=True` and its guards only check sizes, dtypes and the hyperparameters' values.

    update = aotgrad.OptimizerStep(opt)
    compiled = torch.compile(update.function, fullgraph=True, backend="aotgrad").aot_compile(
        (update.arguments(), {}))
    compiled.save_compiled_function("adamw.pt2c")
    # in a new process, after backward():
    step = torch.compiler.load_compiled_function(open("adamw.pt2c", "rb"))
    step(*update.arguments())

Only `torch.optim.Adam` and `AdamW` (their single-tensor and foreach forms): other optimizers are
refused with `UnsupportedOptimizerError`; compile their `step` as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam

from ..errors import AotgradError

# the per-group options the functional `adam` takes, as `Adam.step` passes them (and `capturable`)
_OPTIONS = ("amsgrad", "weight_decay", "eps", "maximize", "foreach", "differentiable", "fused",
            "decoupled_weight_decay")


class UnsupportedOptimizerError(AotgradError):
    """The optimizer's step has no plain-function form here (the message says what to use instead)."""


def adam_update(groups: list[dict[str, Any]]) -> None:
    """One Adam/AdamW update of every group, in place; what `Adam.step` runs after `_init_group`.

    Traced, it takes the `capturable` path (the step counts stay tensors), as Dynamo makes
    `torch.compile(optimizer.step)` do whatever the group says; eagerly, the group's setting."""
    capturable = torch.compiler.is_compiling()
    with torch.no_grad():
        for g in groups:
            adam(g["params"], g["grads"], g["exp_avgs"], g["exp_avg_sqs"], g["max_exp_avg_sqs"], g["state_steps"],
                 has_complex=g["has_complex"], beta1=g["beta1"], beta2=g["beta2"], lr=g["lr"],
                 capturable=capturable or g["capturable"], **{k: g[k] for k in _OPTIONS})


class OptimizerStep:
    """`optimizer.step()` as `function(*arguments())`; see the module docstring."""

    function = staticmethod(adam_update)

    def __init__(self, optimizer: torch.optim.Optimizer):
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise UnsupportedOptimizerError(
                f"OptimizerStep supports torch.optim.Adam and AdamW, not {type(optimizer).__name__}: compile "
                "its step with torch.compile(optimizer.step) instead (Dynamo traces it in each process)")
        for i, group in enumerate(optimizer.param_groups):
            if group.get("fused"):
                raise UnsupportedOptimizerError(
                    f"param group {i} of the optimizer is fused=True: its fused kernel is one op already; "
                    "use foreach or the default, or call optimizer.step() without compiling it")
        if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
            raise UnsupportedOptimizerError("an optimizer with a gradient scaler's grad_scale/found_inf set "
                                            "cannot be stepped through OptimizerStep")
        self.optimizer = optimizer
        _capturable_on_gpus(optimizer)

    def arguments(self) -> tuple[list[dict[str, Any]]]:
        """The positional arguments of `function` for the gradients present now, after initialising
        missing state as `optimizer.step()` would. Call it again for each step: `.grad` may be new tensors."""
        groups = []
        for group in self.optimizer.param_groups:
            lists: dict[str, list] = {k: [] for k in ("params", "grads", "exp_avgs", "exp_avg_sqs",
                                                      "max_exp_avg_sqs", "state_steps")}
            with torch.no_grad():
                has_complex = self.optimizer._init_group(group, *lists.values())
            beta1, beta2 = group["betas"]
            groups.append({**lists, "has_complex": has_complex, "beta1": beta1, "beta2": beta2, "lr": group["lr"],
                           "capturable": group["capturable"], **{k: group[k] for k in _OPTIONS}})
        return (groups,)

    def __call__(self) -> None:
        """Run the step eagerly (the reference the compiled function is checked against)."""
        self.function(*self.arguments())


def _capturable_on_gpus(optimizer: torch.optim.Optimizer) -> None:
    """Make a group `capturable` when all its parameters are on a GPU and none has state yet, as
    Dynamo does to the optimizer `torch.compile(opt.step)` traces: the step counts are then made on
    the GPU (not as CPU scalars beside GPU tensors), and CUDA graphs can capture the update."""
    for group in optimizer.param_groups:
        params = group["params"]
        if params and all(p.is_cuda or p.is_xpu for p in params) and not any(p in optimizer.state for p in params):
            group["capturable"] = True
