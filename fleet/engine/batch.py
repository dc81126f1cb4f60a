"""The vector engine: every client of a simulated fleet trained as one batched
computation, with the agent's math (``edge_agent.train``) step for step.

What a client does in a round is what its ``Agent`` does: take the announcement's
guidance (and, for FedAvg, the averaged weights), shuffle its cached features with its own
generator (seeded as the agent's), train E epochs of batches of 32 with Adam, embed its
training set for its prototypes (FedPCL Eq. 5) and its test set for its scores. Here the
clients of a chunk take each step together: one ``baddbmm`` for their first layers, one
backward pass for their summed losses, one Adam update over the stack
(:mod:`fleet.engine.heads`). tests/test_vector_engine.py holds the two paths to the same
accuracies.

The fleet's features are one matrix (:class:`FleetFeatures`): the backbones ran once per
distinct image, and each client holds indices into it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from edge_agent import inference as inf
from edge_agent.extras import fitting_weights
from edge_agent.head import local_prototypes
from edge_agent.methods import DEVICE_METHODS, device_method
from edge_agent.privacy.mechanisms import MECHANISMS, MechanismParams
from edge_agent.train import Guidance
from edge_agent.train_config import TrainConfig
from fleet.engine.evaluation import FleetEvaluator
from fleet.engine.heads import HeadStack, Rows
from fleet.engine.losses import GROUP_LOSSES
from fleet.engine.side_by_side import in_order

#: The scores of a client's round, as fleet.engine.evaluation.FleetEvaluator names them.
SCORES = ("test_accuracy", "test_accuracy_prototype", "test_accuracy_classifier")

#: The methods a vector run takes: those the engine trains (the others need per-client
#: machinery it lacks: FPL's averaged model with cluster prototypes, FedDBP's second branch
#: and Fisher scores) and the closed-form ones, which train nothing
#: (fleet/transports/vector_closed_form.py).
VECTOR_METHODS = tuple(
    sorted([*GROUP_LOSSES, *(m for m, r in DEVICE_METHODS.items() if not r.trains_head)])
)


def unsupported(method: str) -> str | None:
    """Why the engine cannot train ``method``, or None if it can."""
    if method in VECTOR_METHODS:
        return None
    return (
        f"--transport vector trains {', '.join(VECTOR_METHODS)}; {method} needs "
        "--transport memory or mqtt"
    )


@dataclass(frozen=True)
class FleetFeatures:
    """The fleet's cached backbone features (U, D) float32, and per client the rows it
    holds (``train_index``, ``test_index``) with their labels."""

    features: np.ndarray
    train_index: tuple[np.ndarray, ...]
    train_labels: tuple[np.ndarray, ...]
    test_index: tuple[np.ndarray, ...]
    test_labels: tuple[np.ndarray, ...]

    @property
    def clients(self) -> int:
        return len(self.train_index)

    def pooled(self, *, clients: int, train: int, test: int, seed: int) -> FleetFeatures:
        """``clients`` clients drawn from these ones: client i draws ``train`` of client
        (i mod P)'s training rows and ``test`` of its test rows (seeded, without
        replacement). For fleets of 10,000 at the cost of P clients' images: the
        backbones run once per pooled image, and clients of one pool share samples."""
        pool = self.clients
        if (
            min(len(i) for i in self.train_index) < train
            or min(len(i) for i in self.test_index) < test
        ):
            raise ValueError(f"every pooled client needs {train} training and {test} test rows")
        rng = np.random.default_rng(seed)
        out: dict[str, list[np.ndarray]] = {n: [] for n in ("tr", "trl", "te", "tel")}
        for i in range(clients):
            j = i % pool
            a = rng.choice(len(self.train_index[j]), size=train, replace=False)
            b = rng.choice(len(self.test_index[j]), size=test, replace=False)
            out["tr"].append(self.train_index[j][a])
            out["trl"].append(self.train_labels[j][a])
            out["te"].append(self.test_index[j][b])
            out["tel"].append(self.test_labels[j][b])
        return FleetFeatures(features=self.features, train_index=tuple(out["tr"]),
                             train_labels=tuple(out["trl"]), test_index=tuple(out["te"]),
                             test_labels=tuple(out["tel"]))  # fmt: skip


@dataclass(frozen=True)
class ClientRound:
    """What one client's round produced: the release that leaves it, the trained weights an
    averaged method sends, and its scores (its local prototypes stay in ``local``)."""

    release_classes: np.ndarray
    release_protos: np.ndarray
    release_counts: np.ndarray
    weights: dict[str, np.ndarray]
    scores: dict[str, float | None]


#: Clients trained together. Not more: a step's weight gradients and Adam moments are
#: (chunk x D x 256) floats each, 12.6 MB at 64 clients of D = 192, and past the caches
#: those memory-bound passes slow down. Trained one chunk at a time, 64 took a client in
#: about 1.05-1.2 ms, 256 in 1.1-1.65 ms (FedPCL and FedAvg, 512 clients of 100 samples,
#: development machine); two at a time (``threads``), 64 and 128 ran a 1,000-client
#: FedAvg round alike (1.17-1.24 s against 1.16-1.17 s).
CHUNK = 64


class VectorEngine:
    def __init__(self, *, data: FleetFeatures, method: str, num_classes: int, cfg: TrainConfig,
                 seeds: list[int], init_seeds: list[int], chunk: int = CHUNK,
                 evaluate: bool = True, threads: int | None = None) -> None:  # fmt: skip
        """``evaluate``: score every client on its test rows after each round (and on
        what the coordinator returns); off, the scores are None and the round is the
        training and the updates alone. ``threads``: chunks trained at once, one core each
        (fleet/engine/side_by_side.py); by default as many as torch has threads."""
        refusal = unsupported(method)
        if refusal is not None:
            raise ValueError(refusal)
        if len(seeds) != data.clients or len(init_seeds) != data.clients:
            raise ValueError("one seed and one initial seed per client")
        self.data, self.method, self.cfg, self.evaluate = data, method, cfg, evaluate
        self.num_classes, self.chunk = num_classes, chunk
        self.threads = torch.get_num_threads() if threads is None else threads
        self.features = torch.from_numpy(np.ascontiguousarray(data.features, dtype=np.float32))
        self.stack = HeadStack.initial(seeds=init_seeds, in_dim=data.features.shape[1],
                                       num_classes=num_classes, cfg=cfg, method=method)  # fmt: skip
        # The data order is public randomness from each client's seed, as an agent's.
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.loss = GROUP_LOSSES[method]
        self.record = device_method(method)
        self.rule = self.record.rule
        self.release = MECHANISMS["none"].release
        # The prototypes each client holds (its last round's), for rules that need them.
        self.local: list[tuple[np.ndarray, np.ndarray] | None] = [None] * data.clients

    # -- a round ---------------------------------------------------------------------------

    def train_round(self, guidance: Guidance) -> Iterator[tuple[int, ClientRound]]:
        """Train every client one round; yield (client, its round) as each chunk ends,
        in client order. Chunks train side by side (:func:`fleet.engine.side_by_side.in_order`):
        each writes only its own rows of the stack and its clients' generators."""
        if self.record.wire.local_sets:  # its targets, cached on the guidance: built once, here
            guidance.fedpcl_targets(tau=self.cfg.tau, include_positive=self.cfg.include_positive)

        def chunk(rows: Rows) -> list[tuple[int, ClientRound]]:
            self._train_chunk(rows, guidance)
            return list(self._finish_chunk(rows))

        for done in in_order(chunk, self.stack.chunks(self.chunk), threads=self.threads):
            yield from done

    def _train_chunk(self, rows: Rows, guidance: Guidance) -> None:
        cfg = self.cfg
        for _ in range(cfg.epochs):
            orders = [
                torch.randperm(len(self.data.train_index[k]), generator=self.generators[k])
                for k in range(rows.start, rows.stop)
            ]
            for group, order in _by_size(rows, orders):
                n = len(order[0])
                idx = torch.stack([torch.from_numpy(self.data.train_index[k]) for k in _ids(group)])
                lab = torch.stack(
                    [torch.from_numpy(self.data.train_labels[k]) for k in _ids(group)]
                )
                perm = torch.stack(order)
                idx, lab = idx.gather(1, perm), lab.gather(1, perm)
                for i in range(0, n, cfg.batch_size):
                    cols = slice(i, min(i + cfg.batch_size, n))
                    if cols.stop - cols.start < 2:
                        continue  # BatchNorm cannot normalise a single sample
                    self._step(group, self.features[idx[:, cols]], lab[:, cols], guidance)

    def _step(self, rows: Rows, x: torch.Tensor, y: torch.Tensor, guidance: Guidance) -> None:
        leaves = self.stack.leaves(rows)
        z = self.stack.forward_train(leaves, rows, x)
        logits = self.stack.logits(leaves, z) if self.stack.classifier else None
        self.loss(z, logits, y, guidance, self.cfg).backward()
        self.stack.step(rows, leaves)

    def _finish_chunk(self, rows: Rows) -> Iterator[tuple[int, ClientRound]]:
        data, num_classes = self.data, self.num_classes
        ids = list(range(rows.start, rows.stop))
        train_z, _ = self._embed(rows, [data.train_index[k] for k in ids])
        tests = self._test_outputs(rows) if self.evaluate else None
        # Every client's prototypes and release in one call each: client j's classes are
        # slots j*C .. j*C + C-1 of one long class list, its samples in their own order,
        # so each slot sums exactly what the client's own call would, in the same order.
        sizes = np.array([len(data.train_index[k]) for k in ids])
        groups, longest, dim = train_z.shape
        held = np.arange(longest)[None, :] < sizes[:, None]  # (G, N): not padding
        labels = np.zeros((groups, longest), np.int64)
        for j, k in enumerate(ids):
            labels[j, : sizes[j]] = data.train_labels[k]
        slots = (np.arange(groups)[:, None] * num_classes + labels)[held]
        z = train_z.reshape(groups * longest, dim)[torch.from_numpy(held.reshape(-1))]
        protos_t, counts_t = local_prototypes(z, torch.from_numpy(slots), groups * num_classes)
        protos = protos_t.view(groups, num_classes, dim).numpy()
        counts = counts_t.view(groups, num_classes).numpy()
        release = self.release(z.numpy(), slots, groups * num_classes, MechanismParams(), _NO_NOISE)
        bounds = np.searchsorted(release.classes // num_classes, np.arange(groups + 1))
        weights = self.stack.arrays_of_rows(rows) if self.record.wire.averaged else [{}] * len(ids)
        for j, k in enumerate(ids):
            self.local[k] = (protos[j], counts[j])
            scores = (
                self._after_training(k, tests[j], protos[j], counts[j])
                if tests is not None
                else dict.fromkeys(SCORES)
            )
            part = slice(bounds[j], bounds[j + 1])
            yield (
                k,
                ClientRound(
                    release_classes=release.classes[part] - j * num_classes,
                    release_protos=release.prototypes[part],
                    release_counts=release.counts[part],
                    weights=weights[j],
                    scores=scores,
                ),
            )

    def _embed(
        self, rows: Rows, index: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eval-mode (z, logits) of each client's rows, padded to the longest (padding
        rows hold sample 0 and are cut by the caller)."""
        longest = max(len(i) for i in index)
        padded = np.zeros((len(index), longest), np.int64)
        for j, i in enumerate(index):
            padded[j, : len(i)] = i
        return self.stack.forward_eval(rows, self.features[torch.from_numpy(padded)])

    def _test_outputs(self, rows: Rows) -> list[inf.Outputs]:
        """Each client's model outputs on its test rows."""
        index = [self.data.test_index[k] for k in range(rows.start, rows.stop)]
        z, logits = self._embed(rows, index)
        # A method without a classifier has no logits; its rules never read them.
        return [
            inf.Outputs(
                z=z[j, : len(i)].numpy(),
                logits=(
                    logits[j, : len(i)].numpy()
                    if logits is not None
                    else np.zeros((len(i), self.num_classes), np.float32)
                ),
            )
            for j, i in enumerate(index)
        ]

    # -- scores, by fleet.engine.evaluation.FleetEvaluator ---------------------------------------

    def _evaluator(self, k: int) -> FleetEvaluator:
        """Client k's evaluator, scoring outputs the engine computed (it runs no model)."""
        return FleetEvaluator(method=self.method, features=_NO_FEATURES,
                              labels=self.data.test_labels[k])  # fmt: skip

    def _after_training(
        self, k: int, out: inf.Outputs, protos: np.ndarray, counts: np.ndarray
    ) -> dict[str, float | None]:
        refs = inf.References(local=protos, local_present=counts > 0)
        return self._evaluator(k).scores(out, refs)

    def adopt(self, extras: Mapping[str, np.ndarray]) -> None:
        """FedAvg: every client continues from the announced average (the weights that
        fit, as ``edge_agent.extras.load_weights``)."""
        fitting = fitting_weights(self.stack.state_of(0), extras)
        if fitting:
            self.stack.load(slice(None), fitting)

    def from_server(self, globals_: tuple[np.ndarray, np.ndarray] | None) -> list[float | None]:
        """Each client's own score on what the coordinator returned (the averaged model
        just adopted, or the global prototypes), with its last round's local prototypes."""
        scores: list[float | None] = []
        for rows in self.stack.chunks(self.chunk):
            if not self.evaluate:
                scores += [None] * (rows.stop - rows.start)
                continue
            outputs = self._test_outputs(rows)
            for j, k in enumerate(range(rows.start, rows.stop)):
                out = outputs[j]
                local = self.local[k]
                refs = inf.References(
                    local=None if local is None else local[0],
                    local_present=None if local is None else local[1] > 0,
                    global_=None if globals_ is None else globals_[0],
                    global_present=None if globals_ is None else globals_[1],
                )
                scores.append(self._evaluator(k).own(out, refs))
        return scores


_NO_NOISE = np.random.default_rng(0)  # the exact release draws nothing
_NO_FEATURES = np.zeros((0, 0), np.float32)


def _ids(rows: Rows) -> list[int]:
    return list(range(rows.start, rows.stop)) if rows.index is None else rows.index.tolist()


def _by_size(rows: Rows, orders: list[torch.Tensor]) -> Iterator[tuple[Rows, list[torch.Tensor]]]:
    """The chunk's clients grouped by training-set size (one batch schedule per group): the
    whole chunk as views when every client holds as many samples, else an index per size."""
    sizes = [len(o) for o in orders]
    if len(set(sizes)) == 1:
        yield rows, orders
        return
    for size in sorted(set(sizes)):
        members = [j for j, s in enumerate(sizes) if s == size]
        index = torch.tensor([rows.start + j for j in members], dtype=torch.long)
        yield Rows(rows.start, rows.stop, index), [orders[j] for j in members]
