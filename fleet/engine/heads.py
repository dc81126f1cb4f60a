"""Many clients' local models held as stacked tensors: the vector engine's model.

Client k's ``LocalModel`` (FedPCL Table 7's head ``FC -> ReLU -> BN``, L2-normalised, and
a linear classifier on ``z``) is row k of every tensor here, laid out as the agent lays
it out (the head's weight as ``(in, out)``, like ``InputMajorLinear.weight_t``), so one
``baddbmm`` runs the first layer of a whole group of clients. Adam's update is written out
over the stack with a step count per client, as ``torch.optim.Adam`` keeps one per
device. Why: at 10,000 clients a per-client module, optimiser and Python step loop cost
far more than the arithmetic.

The stack's tensors are plain (no autograd); a training step takes views (or copies) of
the rows it trains as fresh leaves (:meth:`HeadStack.leaves`) and writes Adam's result
back (:meth:`HeadStack.step`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_agent.methods import device_method
from edge_agent.train import LocalModel
from edge_agent.train_config import TrainConfig

#: torch.optim.Adam's defaults, which the agent's optimiser uses.
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
#: BatchNorm1d's defaults.
BN_EPS, BN_MOMENTUM = 1e-5, 0.1

#: Trained tensors by name, with the state-dict key of each (for loading and saving).
TRAINED = {
    "w": "head.fc.weight",
    "b": "head.fc.bias",
    "gamma": "head.norm.weight",
    "beta": "head.norm.bias",
    "cw": "classifier.weight",
    "cb": "classifier.bias",
}
BUFFERS = {"running_mean": "head.norm.running_mean", "running_var": "head.norm.running_var"}


@dataclass(frozen=True)
class Rows:
    """Which clients a step trains: a contiguous range (views, no copy) or an index."""

    start: int
    stop: int
    index: torch.Tensor | None = None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.start : self.stop] if self.index is None else t[self.index]

    def put(self, t: torch.Tensor, value: torch.Tensor) -> None:
        if self.index is None:
            if value.data_ptr() != t[self.start : self.stop].data_ptr():
                t[self.start : self.stop] = value
        else:
            t[self.index] = value


class _Input(torch.autograd.Function):
    """``x W + b`` per client for features x (G, B, in), which take no gradient, and W
    (G, in, out) in the stack's layout. W's gradient is ``x^T g`` from a contiguous copy
    of x^T: bmm multiplies that in 2.2 ms against 3.0 ms for the transposed view autograd
    would pass (64 clients x 32 samples, 192 -> 256), to the same bits as the agent's
    ``mm`` per client."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.baddbmm(b.unsqueeze(1), x, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        return None, torch.bmm(x.transpose(1, 2).contiguous(), grad), grad.sum(dim=1)


class _Linear(torch.autograd.Function):
    """``z W^T + b`` per client for W (G, C, d) in nn.Linear's layout, whose backward
    forms W's gradient as ``g^T z`` (G, C, d), the product autograd forms for the agent's
    ``nn.Linear`` (its weight is the transposed operand there), from a contiguous g^T.
    bmm rounds this product unlike the agent's ``mm`` per client (by up to about 3e-8 on
    a gradient); a loop of per-client products matched it to the bit but cost 0.6 ms a
    step against 0.1 ms (64 clients), and the methods with a classifier are held to
    the agent's weights to 1e-5 (tests/test_vector_engine.py)."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z, w)
        return torch.baddbmm(b.unsqueeze(1), z, w.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z, w = ctx.saved_tensors
        weight = torch.bmm(grad.transpose(1, 2).contiguous(), z)
        return torch.bmm(grad, w), weight, grad.sum(dim=1)


class HeadStack:
    """K clients' heads (and classifiers, for the methods that train one) with their
    BatchNorm statistics and Adam moments."""

    def __init__(self, *, clients: int, in_dim: int, num_classes: int, cfg: TrainConfig,
                 method: str) -> None:  # fmt: skip
        if cfg.norm != "batch":
            raise ValueError("the vector engine implements the BatchNorm head (norm = 'batch')")
        k, d, o, c = clients, in_dim, cfg.out_dim, num_classes
        self.cfg = cfg
        self.classifier = not device_method(method).classifier_free
        self.bounded = cfg.classifier == "bounded"
        self.params: dict[str, torch.Tensor] = {
            "w": torch.zeros(k, d, o),
            "b": torch.zeros(k, o),
            "gamma": torch.ones(k, o),
            "beta": torch.zeros(k, o),
        }
        if self.classifier:
            # nn.Linear's own (out, in) layout: the agent's classifier multiplies by its
            # transpose, and the same GEMM path gives the same rounding.
            self.params |= {"cw": torch.zeros(k, c, o), "cb": torch.zeros(k, c)}
        self.running_mean = torch.zeros(k, o)
        self.running_var = torch.ones(k, o)
        self.tracked = torch.zeros(k, dtype=torch.long)
        self.m = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.steps = torch.zeros(k, dtype=torch.long)
        self.clients = k

    # -- building and reading back -------------------------------------------------------

    @classmethod
    def initial(cls, *, seeds: list[int], in_dim: int, num_classes: int, cfg: TrainConfig,
                method: str) -> HeadStack:  # fmt: skip
        """Every client's model as its agent initialises it (``torch.manual_seed(seed)``
        then ``LocalModel``), one at a time so only one model is ever alive."""
        stack = cls(clients=len(seeds), in_dim=in_dim, num_classes=num_classes, cfg=cfg,
                    method=method)  # fmt: skip
        for k, seed in enumerate(seeds):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                model = LocalModel(in_dim=in_dim, num_classes=num_classes, cfg=cfg)
            stack.load(k, model.state_dict())
        return stack

    def load(self, k: int | slice, state: dict[str, torch.Tensor]) -> None:
        """Client(s) ``k`` take the state-dict entries given (nn.Linear layout)."""
        for name, key in (TRAINED | BUFFERS).items():
            if key not in state or (name in ("cw", "cb") and not self.classifier):
                continue
            value = torch.as_tensor(state[key], dtype=torch.float32)
            if name == "w":
                value = value.t()  # (out, in) -> the stack's (in, out)
            self._tensor(name)[k] = value

    def state_of(self, k: int) -> dict[str, torch.Tensor]:
        """Client k's state dict in ``LocalModel``'s layout (a method without a classifier
        here leaves it out), as copies."""
        out = {key: torch.tensor(a) for key, a in self.arrays_of(k).items()}
        out["head.norm.num_batches_tracked"] = self.tracked[k].clone()
        return out

    def arrays_of(self, k: int) -> dict[str, np.ndarray]:
        """Client k's floating-point state-dict entries (see :meth:`arrays_of_rows`)."""
        return self.arrays_of_rows(Rows(k, k + 1))[0]

    def arrays_of_rows(self, rows: Rows) -> list[dict[str, np.ndarray]]:
        """Each row's floating-point state-dict entries as float32 arrays (what an averaged
        method's update carries: edge_agent.extras.model_weights), copied once for the
        whole range (a transposing copy of 64 heads at once, not 64 small ones) and
        read-only: an update takes a read-only array as it is, where
        protocol.arrays.check_array would copy a writable one a second time."""
        copies: dict[str, np.ndarray] = {}
        for name, key in (TRAINED | BUFFERS).items():
            if name in ("cw", "cb") and not self.classifier:
                continue
            value = rows.take(self._tensor(name))
            if name == "w":
                value = value.transpose(1, 2)  # the stack's (in, out) -> nn.Linear's (out, in)
            copies[key] = value.clone(memory_format=torch.contiguous_format).numpy()
            copies[key].setflags(write=False)
        count = rows.stop - rows.start if rows.index is None else len(rows.index)
        return [{key: a[j] for key, a in copies.items()} for j in range(count)]

    def _tensor(self, name: str) -> torch.Tensor:
        return self.params[name] if name in self.params else getattr(self, name)

    # -- the model -----------------------------------------------------------------------

    def leaves(self, rows: Rows) -> dict[str, torch.Tensor]:
        """The rows' trained tensors as leaves that collect gradients."""
        return {n: rows.take(p).detach().requires_grad_() for n, p in self.params.items()}

    def forward_train(
        self, p: dict[str, torch.Tensor], rows: Rows, x: torch.Tensor
    ) -> torch.Tensor:
        """z (G, B, out) of a training batch x (G, B, in); BatchNorm normalises with the
        batch's statistics and updates the rows' running ones, as ``model.train()`` does."""
        a = torch.relu(_Input.apply(x, p["w"], p["b"]))
        h = self._batch_norm(a, rows, p["gamma"], p["beta"], training=True)
        return nn.functional.normalize(h, dim=-1)

    def _batch_norm(self, a: torch.Tensor, rows: Rows, gamma: torch.Tensor, beta: torch.Tensor,
                    *, training: bool) -> torch.Tensor:  # fmt: skip
        """BatchNorm1d of each client's (B, out) slice at once: the group's units side by
        side as (B, G*out) channels, so the one kernel the agent's layer calls computes
        every client's statistics (over its own batch) to the same bits."""
        g, b, o = a.shape
        mean, var = rows.take(self.running_mean), rows.take(self.running_var)
        flat_mean, flat_var = mean.view(-1), var.view(-1)  # views of the stack for a range
        h = nn.functional.batch_norm(
            a.transpose(0, 1).reshape(b, g * o), flat_mean, flat_var, gamma.reshape(-1),
            beta.reshape(-1), training=training, momentum=BN_MOMENTUM, eps=BN_EPS,
        )  # fmt: skip
        if training:
            with torch.no_grad():
                rows.put(self.running_mean, mean)
                rows.put(self.running_var, var)
                rows.put(self.tracked, rows.take(self.tracked) + 1)
        return h.view(b, g, o).transpose(0, 1).contiguous()

    def logits(self, p: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
        out = _Linear.apply(z, p["cw"], p["cb"])  # (G, B, C)
        if self.bounded:
            out = nn.functional.normalize(torch.relu(out), dim=-1)
        return out

    @torch.no_grad()
    def forward_eval(self, rows: Rows, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z, logits or None) of x (G, N, in) in eval mode (running statistics)."""
        p = {n: rows.take(t) for n, t in self.params.items()}
        a = torch.relu(torch.baddbmm(p["b"].unsqueeze(1), x, p["w"]))
        z = nn.functional.normalize(
            self._batch_norm(a, rows, p["gamma"], p["beta"], training=False), dim=-1
        )
        return z, (self.logits(p, z) if self.classifier else None)

    # -- Adam ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, rows: Rows, leaves: dict[str, torch.Tensor]) -> None:
        """One Adam step of the rows: the fused kernel ``torch.optim.Adam(fused=True)`` runs
        for the agent. Every row of a step shares one step count, as the engine trains a
        group of clients holding as many samples together (the same batches, so the same
        number of steps)."""
        steps = rows.take(self.steps) + 1
        count = int(steps[0])
        if not bool((steps == count).all()):
            raise RuntimeError("one training step over clients at different Adam steps")
        rows.put(self.steps, steps)
        names = list(leaves)
        params = [leaves[n].detach() for n in names]
        grads = [leaves[n].grad for n in names]
        if any(g is None for g in grads):  # every trained tensor enters every method's loss
            raise RuntimeError("a trained tensor got no gradient")
        m = [rows.take(self.m[n]) for n in names]
        v = [rows.take(self.v[n]) for n in names]
        cfg = self.cfg
        torch._fused_adam_(
            params, grads, m, v, [],  # type: ignore[arg-type]  # checked above
            [torch.tensor(float(count))] * len(names), amsgrad=False, lr=cfg.lr,
            beta1=BETA1, beta2=BETA2, weight_decay=cfg.weight_decay, eps=EPS,
            maximize=False, grad_scale=None, found_inf=None,
        )  # fmt: skip
        for n, param, m_n, v_n in zip(names, params, m, v, strict=True):
            rows.put(self.params[n], param)
            rows.put(self.m[n], m_n)
            rows.put(self.v[n], v_n)

    def chunks(self, size: int) -> Iterator[Rows]:
        for start in range(0, self.clients, size):
            yield Rows(start, min(start + size, self.clients))
