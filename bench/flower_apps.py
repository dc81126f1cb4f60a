"""The Flower apps of the side-by-side benchmark: a ClientApp whose clients train
ProtoFleet's own head (edge_agent.train) on their rows of the shared workload, and a
ServerApp running Flower's FedAvg with every client in every round and no evaluation.

Imports flwr at the top: only bench/flower_peer.py imports this module, once it has
checked that Flower is installed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.client import Client, ClientApp, NumPyClient
from flwr.common import (
    Context,
    FitIns,
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import (
    Server,
    ServerApp,
    ServerAppComponents,
    ServerConfig,
    SimpleClientManager,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from bench.peer_workload import Workload
from edge_agent.train import Guidance, LocalModel, make_optimiser, train_round
from edge_agent.train_config import TrainConfig

_ARRAYS = ("features", "index", "labels", "offsets")


@dataclass(frozen=True)
class Spill:
    """What crosses into each Ray actor: where the workload lies and its scalars. Ray
    pickles the ClientApp with every message it sends, so the app must not hold the
    (U, D) matrix itself; each actor maps the files once instead."""

    folder: str
    dim: int
    num_classes: int
    epochs: int
    batch_size: int
    seed: int


def spill(workload: Workload, folder: Path) -> Spill:
    """Write ``workload`` as .npy files an actor can memory-map."""
    for name, array in workload.flat().items():
        np.save(folder / f"{name}.npy", array)
    return Spill(
        folder=str(folder),
        dim=workload.dim,
        num_classes=workload.num_classes,
        epochs=workload.epochs,
        batch_size=workload.batch_size,
        seed=workload.seed,
    )


#: Per actor process: the mapped arrays of each spilled workload, mapped at first use.
_MAPPED: dict[str, dict[str, np.ndarray]] = {}


def _client_rows(where: Spill, client: int) -> tuple[np.ndarray, np.ndarray]:
    if where.folder not in _MAPPED:
        # One actor runs one client at a time: torch's intra-op threads would only
        # contend with the other actors for the machine's cores.
        torch.set_num_threads(1)
        _MAPPED[where.folder] = {
            name: np.load(Path(where.folder) / f"{name}.npy", mmap_mode="r") for name in _ARRAYS
        }
    mapped = _MAPPED[where.folder]
    start, stop = int(mapped["offsets"][client]), int(mapped["offsets"][client + 1])
    rows = np.asarray(mapped["index"][start:stop])
    return np.asarray(mapped["features"][rows]), np.array(mapped["labels"][start:stop])


def _config(where: Spill) -> TrainConfig:
    return TrainConfig(epochs=where.epochs, batch_size=where.batch_size)


def _model(where: Spill, cfg: TrainConfig) -> LocalModel:
    return LocalModel(in_dim=where.dim, num_classes=where.num_classes, cfg=cfg)


def _weights(model: LocalModel) -> NDArrays:
    return [v.numpy() for v in model.state_dict().values()]


class HeadClient(NumPyClient):
    """One client: FedAvg's local step is ProtoFleet's ``train_round`` on its rows, from a
    fresh optimiser each round (a Flower client keeps no state between rounds)."""

    def __init__(self, where: Spill, client: int) -> None:
        self.where, self.client = where, client

    def fit(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        where = self.where
        features, labels = _client_rows(where, self.client)
        cfg = _config(where)
        model = _model(where, cfg)
        keys = list(model.state_dict())
        model.load_state_dict({k: torch.tensor(v) for k, v in zip(keys, parameters, strict=True)})
        seed = np.random.SeedSequence([where.seed, self.client, int(config["round"])])
        metrics = train_round(
            model,
            make_optimiser(model, cfg),
            features,
            labels,
            method="fedavg",
            guidance=Guidance.empty(where.num_classes, cfg.out_dim),
            cfg=cfg,
            generator=torch.Generator().manual_seed(int(seed.generate_state(1)[0])),
        )
        return _weights(model), metrics.samples, {"loss": metrics.loss}


def _client_fn(where: Spill, context: Context) -> Client:
    return HeadClient(where, int(context.node_config["partition-id"])).to_client()


def client_app(where: Spill) -> ClientApp:
    return ClientApp(client_fn=partial(_client_fn, where))


@dataclass
class RoundClock:
    """Seconds of each round, from the strategy's configure_fit to the end of its
    aggregate_fit: sampling, sending, every client's training, receiving, averaging; and
    the global model each round ended with, kept (as Flower serialised it) after the
    round's time is taken, to be scored once the run is over."""

    seconds: list[float] = field(default_factory=list)
    failures: int = 0
    parameters: list[Parameters | None] = field(default_factory=list)


def named_weights(where: Spill, parameters: Parameters) -> dict[str, np.ndarray]:
    """Flower's parameters (the model's state-dict values in order) by their names."""
    keys = list(_model(where, _config(where)).state_dict())
    return dict(zip(keys, parameters_to_ndarrays(parameters), strict=True))


class TimedFedAvg(FedAvg):
    """FedAvg that stamps each round on a RoundClock."""

    def __init__(self, *, clock: RoundClock, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clock = clock
        self._started = 0.0

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self._started = time.perf_counter()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        out = super().aggregate_fit(server_round, results, failures)
        self.clock.seconds.append(time.perf_counter() - self._started)
        self.clock.failures += len(failures)
        self.clock.parameters.append(out[0])
        return out


def server_app(
    where: Spill, *, clients: int, rounds: int, clock: RoundClock, server_threads: int
) -> ServerApp:
    cfg = _config(where)
    # Seeded without touching torch's global generator (library code sets no seeds).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(where.seed)
        initial = _weights(_model(where, cfg))

    def server_fn(context: Context) -> ServerAppComponents:
        strategy = TimedFedAvg(
            clock=clock,
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=clients,
            min_available_clients=clients,
            # The server starts from these instead of asking one client for its weights.
            initial_parameters=ndarrays_to_parameters(initial),
            on_fit_config_fn=lambda server_round: {"round": server_round},
        )
        server = Server(client_manager=SimpleClientManager(), strategy=strategy)
        # Flower's server sends each client its instructions from a thread pool, one
        # client per thread until it replies; the default pool (cores + 4 threads) keeps
        # six clients in flight on two cores, which leaves actors idle while replies wait
        # for the next 0.1 s poll (bench/flower_peer.py has the figures).
        server.set_max_workers(server_threads)
        return ServerAppComponents(server=server, config=ServerConfig(num_rounds=rounds))

    return ServerApp(server_fn=server_fn)
