"""The AdamW bigclip's engines step: torch's fused kernel, equal to the foreach one that wrote
earlier checkpoints, and able to resume from their optimizer state."""

from __future__ import annotations

import torch

from bigclip.config import OptimConfig
from bigclip.engines.optimizer import make_optimizer, param_groups

OPTIM = OptimConfig(lr=1e-2, wd=0.2)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _foreach(model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay=OPTIM.wd)
    return torch.optim.AdamW(
        groups, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps, foreach=True
    )


def _fused(model: torch.nn.Module) -> torch.optim.Optimizer:
    return make_optimizer(param_groups(model, weight_decay=OPTIM.wd), OPTIM)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_engines_step_fused_adamw_with_foreach_results() -> None:
    reference, model = _model(), _model()
    optimizer = _fused(model)
    assert optimizer.defaults["fused"]
    _steps(reference, _foreach(reference), range(5))
    _steps(model, optimizer, range(5))
    _assert_same(reference, model)


def test_parameters_without_a_fused_kernel_get_the_foreach_step() -> None:
    model = _model().to("meta")  # e.g. a model not yet materialised
    assert not _fused(model).defaults["fused"]
