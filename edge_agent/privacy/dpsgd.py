"""One round of the local objective trained with DP-SGD (Opacus).

Per-sample gradients (Opacus GradSampleModule), each clipped to ``max_grad_norm``,
Gaussian noise of ``noise_multiplier * max_grad_norm`` on their sum, and Poisson sampling:
each step takes every example independently with probability ``q``, which is the sampling
the accountant's subsampled-Gaussian analysis assumes. ``q``, the number of steps and the
divisor of the noisy sum come from the public schedule (``accounting.sgd_schedule``),
never from the number of examples held; masks and noise come from the agent's secret
generator (``privacy.randomness``), never from the run's seed. The head must use
GroupNorm (BatchNorm mixes the samples of a batch, so one example's gradient would depend
on the others). A loss that compares a sample with statistics of its batch is not
per-sample either: without global prototypes (round 0) the contrastive objectives fall
back to the classifier's cross-entropy.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.head import InputMajorLinear
from edge_agent.methods import device_method
from edge_agent.privacy.accounting import Schedule
from edge_agent.train import (
    Guidance,
    LocalModel,
    RoundMetrics,
    fedpcl_objective,
    loss_for,
)
from edge_agent.train_config import TrainConfig

_WRAPPERS: weakref.WeakKeyDictionary[LocalModel, Any] = weakref.WeakKeyDictionary()


def _register_grad_samplers() -> None:
    """Per-sample gradients of the head's first layer in closed form, as Opacus has them for
    nn.Linear (without this Opacus would fall back to vmap over the layer)."""
    from opacus.grad_sample import register_grad_sampler

    @register_grad_sampler(InputMajorLinear)
    def _input_major_linear(
        layer: InputMajorLinear, activations: list[torch.Tensor], backprops: torch.Tensor
    ) -> dict[nn.Parameter, torch.Tensor]:
        x = activations[0].to(backprops.dtype)  # (B, in); backprops (B, out)
        return {
            layer.weight_t: torch.einsum("ni,no->nio", x, backprops),  # (B, in, out)
            layer.bias: backprops,
        }


def _per_sample_loss(
    model: Any, method: str, r: torch.Tensor, y: torch.Tensor, g: Guidance, cfg: TrainConfig
) -> torch.Tensor:
    record = device_method(method)
    if not (record.classifier_free or (record.dp_warmup and not g.has_globals)):
        return loss_for(method)(model, r, y, g, cfg)
    z, logits = model(r)  # one forward: Opacus pairs each activation with its backward
    if not g.has_globals:
        return nn.functional.cross_entropy(logits, y)
    # A classifier-free loss (FedPCL's, the only one) never touches the classifier, but
    # Opacus needs a per-sample gradient for every trainable parameter it was given: a
    # zero-weighted term supplies zeros.
    return fedpcl_objective(z, y, g, cfg) + 0.0 * logits.sum()


def _noise_step(dp_opt: Any, noise: torch.Generator) -> None:
    std = dp_opt.noise_multiplier * dp_opt.max_grad_norm
    for p in dp_opt.params:
        draw = torch.normal(0.0, std, size=p.shape, generator=noise, dtype=p.dtype)
        p.grad = (draw / dp_opt.expected_batch_size).view_as(p)
    dp_opt.original_optimizer.step()
    dp_opt.original_optimizer.zero_grad(set_to_none=True)


def train_round_dp(
    model: LocalModel,
    optimiser: torch.optim.Optimizer,
    features: np.ndarray,
    labels: np.ndarray,
    *,
    method: str,
    guidance: Guidance,
    cfg: TrainConfig,
    schedule: Schedule,
    noise: torch.Generator,
    noise_multiplier: float,
    max_grad_norm: float,
) -> RoundMetrics:
    """``schedule.steps`` DP-SGD steps, each on a Poisson sample drawn with ``noise``."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    if cfg.norm != "group":
        raise ValueError("DP-SGD needs train.norm = 'group' (BatchNorm is not per-sample)")
    if "dp" not in device_method(method).modes:
        raise ValueError(f"DP-SGD is not supported for {method}")
    start = time.perf_counter()
    n = len(labels)
    y_all = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    # One wrapper per model for its whole life: Opacus's hooks do not come back on a
    # module that was wrapped and released before.
    wrapped = _WRAPPERS.get(model)
    if wrapped is None:
        _register_grad_samplers()
        wrapped = _WRAPPERS[model] = GradSampleModule(model, loss_reduction="mean")
    dp_opt = DPOptimizer(
        optimiser,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=schedule.expected_batch,
        loss_reduction="mean",
        generator=noise,
    )
    total, nonempty = 0.0, 0
    wrapped.train()
    for _ in range(schedule.steps):
        mask = torch.rand(n, generator=noise) < schedule.sample_rate  # Poisson sampling
        idx = torch.nonzero(mask).flatten()
        if len(idx) == 0:
            # An empty draw is still a step of the mechanism the accountant prices: the
            # noise alone, scaled as a batch's would be. Skipping it would make "nothing
            # moved" an output whose probability depends on how many examples there are.
            _noise_step(dp_opt, noise)
            continue
        r = torch.from_numpy(np.asarray(features[idx.numpy()], dtype=np.float32))
        dp_opt.zero_grad(set_to_none=True)
        loss = _per_sample_loss(wrapped, method, r, y_all[idx], guidance, cfg)
        with warnings.catch_warnings():
            # The cached features need no gradient; Opacus's hooks warn about it.
            warnings.filterwarnings("ignore", message="Full backward hook")
            loss.backward()
        dp_opt.step()
        total += float(loss.detach())
        nonempty += 1
    dp_opt.zero_grad(set_to_none=True)  # drop the last per-sample gradients (memory)
    return RoundMetrics(
        loss=total / max(nonempty, 1),
        samples=n,
        steps=schedule.steps,
        seconds=time.perf_counter() - start,
    )
