"""`OptimizerStep` (backend/optimizer_step.py): an Adam/AdamW step as a plain function, equal to
`optimizer.step()` eagerly, compiled, and saved by precompile in one process and loaded in another.

    python tests/backend/test_optimizer_step.py save|load BACKEND FOLDER
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from aotgrad.backend.optimizer_step import OptimizerStep, UnsupportedOptimizerError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, run as a script
from helpers import assert_same_results, run_job_script  # noqa: E402

HERE = os.path.abspath(__file__)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(i))


OPTIMIZERS = {
    "adamw_tensor_lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(2e-3), weight_decay=0.1, betas=(0.9, 0.95)),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, amsgrad=True),
    "adam_foreach_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True, maximize=True),
    "adamw_two_groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3, "weight_decay": 0.0}], lr=1e-2),
}


def _train(model, step, n: int = 3) -> dict:
    """`n` steps (`step()` after each backward); the parameters and the optimizer state after."""
    for i in range(n):
        model(_batch(i)).pow(2).sum().backward()
        step()
        for p in model.parameters():
            p.grad = None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _state(opt) -> list:
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_eager_equals_optimizer_step(name):
    """The split (eager `_init_group`, then the functional update) is `optimizer.step()` bitwise."""
    a, b = _model(), _model()
    opt_a, opt_b = OPTIMIZERS[name](list(a.parameters())), OPTIMIZERS[name](list(b.parameters()))
    assert_same_results(_train(a, OptimizerStep(opt_a)), _train(b, opt_b.step), exact=True, where=name)
    assert_same_results(_state(opt_a), _state(opt_b), exact=True, where=f"{name} state")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_function_equals_compiled_step(name):
    """`torch.compile(function, fullgraph=True)` traces without a graph break and updates as
    `torch.compile(optimizer.step)` does (step counts exactly; parameters and moments to float
    rounding), and as eager's `optimizer.step()` to float rounding."""
    a, b = _model(), _model()
    opt_a, opt_b = OPTIMIZERS[name](list(a.parameters())), OPTIMIZERS[name](list(b.parameters()))
    update = OptimizerStep(opt_a)
    compiled = torch.compile(update.function, fullgraph=True, backend="aotgrad_eager")
    got = _train(a, lambda: compiled(*update.arguments()))
    want = _train(b, torch.compile(opt_b.step, backend="aotgrad_eager"))
    assert_same_results(got, want, exact=False, where=name)
    assert_same_results(_state(opt_a), _state(opt_b), exact=False, where=f"{name} state")
    assert_same_results([s["step"] for s in _state(opt_a)], [s["step"] for s in _state(opt_b)], exact=True,
                        where=f"{name} steps")
    c = _model()
    opt_c = OPTIMIZERS[name](list(c.parameters()))
    assert_same_results(got, _train(c, opt_c.step), exact=False, where=f"{name} vs eager")


def test_other_optimizers_refused():
    params = list(_model().parameters())
    with pytest.raises(UnsupportedOptimizerError, match="SGD.*torch.compile\\(optimizer.step\\)"):
        OptimizerStep(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(UnsupportedOptimizerError, match="fused=True"):
        OptimizerStep(torch.optim.AdamW(params, lr=0.1, fused=True))


# ----------------------------------------------------------------------------------------------
# Precompile: saved in one process, loaded in another
# ----------------------------------------------------------------------------------------------


def _job(mode: str, backend: str, folder: str) -> None:
    """Three steps of the model with AdamW; the update `aot_compile`d (save) or loaded (load)."""
    model = _model()
    opt = OPTIMIZERS["adamw_tensor_lr"](list(model.parameters()))
    update = OptimizerStep(opt)
    path = os.path.join(folder, "adamw.bin")
    results = {}
    if mode == "save":
        twin = copy.deepcopy(model)
        results["eager"] = _train(twin, OPTIMIZERS["adamw_tensor_lr"](list(twin.parameters())).step)
        model(_batch(0)).pow(2).sum().backward()  # the gradients the example arguments need
        compiled = torch.compile(update.function, fullgraph=True, backend=backend).aot_compile(
            (update.arguments(), {}))
        compiled.save_compiled_function(path)
        for p in model.parameters():
            p.grad = None
        model, opt = _model(), None  # start again from the same weights and an empty state
        opt = OPTIMIZERS["adamw_tensor_lr"](list(model.parameters()))
        update = OptimizerStep(opt)
    else:
        with open(path, "rb") as f:
            compiled = torch.compiler.load_compiled_function(f)
    results["compiled"] = _train(model, lambda: compiled(*update.arguments()))
    results["state"] = _state(opt)
    torch.save(results, os.path.join(folder, f"{mode}.pt"))


def _run(mode: str, backend: str, folder, cache_dir) -> dict:
    return run_job_script(HERE, mode, backend, folder, cache_dir)


@pytest.mark.parametrize("backend", [pytest.param("aotgrad", marks=pytest.mark.long), "aotgrad_eager"])
def test_saved_in_one_process_loaded_in_another(tmp_path, backend):
    """The loaded update, in a fresh process with an empty Inductor cache, trains exactly as the
    compiled one did in the saving process, and as eager's `optimizer.step()` to float rounding.
    Its graph holds `prims.fma` (Dynamo's form of `addcmul_` with a value), which a process that has
    not imported Inductor's prims could not unpickle before `cache.serialize.load_graph` imported them."""
    saved = _run("save", backend, tmp_path, tmp_path / "cache-save")
    loaded = _run("load", backend, tmp_path, tmp_path / "cache-load")
    assert_same_results(loaded["compiled"], saved["compiled"], exact=True, where="loaded vs cold")
    assert_same_results(loaded["state"], saved["state"], exact=True, where="state loaded vs cold")
    assert_same_results(saved["compiled"], saved["eager"], exact=False, where="cold vs eager")
    assert all(float(s["step"]) == 3.0 for s in loaded["state"])


if __name__ == "__main__":
    _job(*sys.argv[1:4])
