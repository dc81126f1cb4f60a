"""The agent's state directory. Every file is written atomically (temp file, fsync,
rename, fsync of the folder), and ``state.json`` is written last: it is the commit point
of a round, so after a crash the directory holds either the previous round or the new one
complete, never a mix.

Layout::

    state.json          agent id, bundle id, last round answered, pending update, history
    head.npz            model weights as plain arrays (no pickle)
    prototypes.npz      local prototypes and counts, for prediction
    globals.npz         the last global prototypes announced to this device, for the methods
                        that predict with them (edge_agent.inference)
    update-<round>.bin  the encoded update of the last round, until it is published
    feature_release.npz dp-features: the data version's one noisy release, sent every round
    anchored.npz        dp-features: the candidate models (edge_agent.anchored)
    privacy.json        the privacy ledger (edge_agent.privacy.ledger)
    cache/              feature cache (edge_agent.features)
    providers/          TensorRT engine and timing caches
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.privacy.mechanisms import Release
from runtime.files import atomic_write

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of an .npz (no pickle), to be written atomically."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    return buffer.getvalue()


@dataclass(frozen=True)
class Snapshot:
    agent_id: str
    bundle_id: str | None = None
    last_round: int | None = None
    pending_round: int | None = None  # answered and stored, not yet acknowledged by the broker
    #: The coordinator run followed (its id and start), in which ``last_round`` counts.
    run: str | None = None
    run_started: float | None = None
    history: tuple[dict[str, Any], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "agent_id": self.agent_id,
            "bundle_id": self.bundle_id,
            "last_round": self.last_round,
            "pending_round": self.pending_round,
            "run": self.run,
            "run_started": self.run_started,
            "history": list(self.history),
            "extra": self.extra,
        }


def _damaged(path: Path, why: str) -> str:
    # Written atomically, so only a failing disk or a hand edit gets here. Guessing the
    # last round answered could answer one twice; the user decides.
    return (
        f"{path} is damaged ({why}); move it aside to start this agent afresh "
        "(its feature cache and privacy ledger are kept)"
    )


class StateDir:
    def __init__(
        self, root: Path, *, agent_id: str, history: int = 200, create: bool = True
    ) -> None:
        """``create=False`` for commands that only read (status, predict): looking must not
        leave an empty state folder behind, at a path that may have been mistyped."""
        self.root = root
        if create:
            root.mkdir(parents=True, exist_ok=True)
        self.agent_id = agent_id
        self.history_limit = history  # rounds of metrics kept, the newest
        self.snapshot = self._read()

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def providers_dir(self) -> Path:
        return self.root / "providers"

    def _read(self) -> Snapshot:
        path = self.root / "state.json"
        if not path.exists():
            return Snapshot(agent_id=self.agent_id)
        try:
            data = json.loads(path.read_bytes())
        except ValueError as exc:  # not JSON, or not UTF-8: a disk that failed under it
            raise ValueError(_damaged(path, str(exc))) from None
        if not isinstance(data, dict):
            raise ValueError(_damaged(path, "not a JSON object"))
        if data.get("agent_id") != self.agent_id:
            raise ValueError(
                f"{self.root} belongs to agent {data.get('agent_id')!r}, not {self.agent_id!r}"
            )
        return Snapshot(
            agent_id=data["agent_id"],
            bundle_id=data.get("bundle_id"),
            last_round=data.get("last_round"),
            pending_round=data.get("pending_round"),
            run=data.get("run"),
            run_started=data.get("run_started"),
            history=tuple(data.get("history", ())),
            extra=data.get("extra", {}),
        )

    def _commit(self, snapshot: Snapshot) -> None:
        atomic_write(self.root / "state.json", json.dumps(snapshot.to_json(), indent=1).encode())
        self.snapshot = snapshot

    def reset_for_bundle(self, bundle_id: str) -> None:
        """A new bundle starts the head afresh: old weights embed other features."""
        if self.snapshot.bundle_id != bundle_id:
            for name in ("head.npz", "prototypes.npz", "globals.npz"):
                (self.root / name).unlink(missing_ok=True)
            self._commit(
                Snapshot(agent_id=self.agent_id, bundle_id=bundle_id, history=self.snapshot.history)
            )

    def save_round(
        self,
        round_: int,
        *,
        model: nn.Module | None,
        prototypes: np.ndarray,
        counts: np.ndarray,
        update: bytes,
        metrics: dict[str, Any],
    ) -> None:
        """Persist everything a round produced, then commit it with state.json (``model``:
        None for a device that trains none, a closed-form method's)."""
        if model is not None:
            self.save_model(model)
        atomic_write(
            self.root / "prototypes.npz", npz_bytes({"prototypes": prototypes, "counts": counts})
        )
        atomic_write(self.root / f"update-{round_}.bin", update)
        history = (*self.snapshot.history, {"round": round_, **metrics})[-self.history_limit :]
        self._commit(
            replace(self.snapshot, last_round=round_, pending_round=round_, history=history)
        )

    def follow_run(self, run: str, started: float, *, keep_round: bool) -> None:
        """Follow coordinator run ``run`` (begun at ``started``) from now on. A new run's
        rounds are counted afresh (``keep_round`` False): the last round answered and any
        unsent update belong to the run left behind."""
        snapshot = replace(self.snapshot, run=run, run_started=started)
        if not keep_round:
            snapshot = replace(snapshot, last_round=None, pending_round=None)
        self._commit(snapshot)

    def save_model(self, model: nn.Module) -> None:
        """Replace head.npz outside a round's commit (FedAvg's adopted global model): a
        crash before the next commit resumes from a model the device would adopt again."""
        atomic_write(
            self.root / "head.npz",
            npz_bytes({k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}),
        )

    def save_globals(self, prototypes: np.ndarray, present: np.ndarray) -> None:
        atomic_write(
            self.root / "globals.npz", npz_bytes({"prototypes": prototypes, "present": present})
        )

    def load_globals(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The last global prototypes kept (C, d) and their mask (C,), if any."""
        return self._load_pair("globals.npz", "prototypes", "present")

    def pending_update(self) -> tuple[int, bytes] | None:
        r = self.snapshot.pending_round
        if r is None:
            return None
        path = self.root / f"update-{r}.bin"
        return (r, path.read_bytes()) if path.exists() else None

    def mark_published(self, round_: int) -> None:
        if self.snapshot.pending_round == round_:
            self._commit(replace(self.snapshot, pending_round=None))
        for old in self.root.glob("update-*.bin"):
            if old.name != f"update-{self.snapshot.pending_round}.bin":
                old.unlink(missing_ok=True)

    def amend_round(self, round_: int, **metrics: Any) -> None:
        """Add figures to round ``round_``'s history entry once they are known (FedAvg's
        global-model accuracy arrives with the next announcement). Idempotent."""
        history = tuple(
            {**h, **metrics} if h.get("round") == round_ else h for h in self.snapshot.history
        )
        if history != self.snapshot.history:
            self._commit(replace(self.snapshot, history=history))

    def record(self, **extra: Any) -> None:
        self._commit(replace(self.snapshot, extra={**self.snapshot.extra, **extra}))

    def load_model(self, model: nn.Module) -> bool:
        """Load head.npz into ``model``; False if there is none or it does not fit."""
        path = self.root / "head.npz"
        if not path.exists():
            return False
        import torch  # here, not at the top: `edge-agent status` reads this folder without it

        with np.load(path, allow_pickle=False) as data:
            state = {k: torch.from_numpy(data[k]) for k in data.files}
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            # Said, not silent: an edited [train] out_dim or method leaves the saved head
            # unusable, and an operator should know why training starts over.
            detail = " ".join(str(exc).split())
            log.warning("%s does not fit the configured head, starting a new one: %s", path, detail)
            return False
        return True

    def save_feature_release(self, version: str, release: Release) -> None:
        """Keep a dp-features release for the data version it was made from."""
        atomic_write(
            self.root / "feature_release.npz",
            npz_bytes({"version": np.array(version), "classes": release.classes,
                        "prototypes": release.prototypes, "counts": release.counts}),
        )  # fmt: skip

    def load_feature_release(self, version: str) -> Release | None:
        """The stored release of data version ``version``; None if there is none (or only
        one of another version: new data is a new release)."""
        path = self.root / "feature_release.npz"
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as data:
            if str(data["version"]) != version:
                return None
            return Release(data["classes"], data["prototypes"], data["counts"])

    def save_statistics_release(self, version: str, arrays: dict[str, np.ndarray]) -> None:
        """Keep a closed-form method's noisy statistics release (its arrays by name) for
        the data version it was made from."""
        atomic_write(
            self.root / "statistics_release.npz",
            npz_bytes({"version": np.array(version), **arrays}),
        )

    def load_statistics_release(self, version: str) -> dict[str, np.ndarray] | None:
        """The stored statistics release of data version ``version``; None if there is
        none (or only one of another version: new data is a new release)."""
        path = self.root / "statistics_release.npz"
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as data:
            if str(data["version"]) != version:
                return None
            return {k: data[k] for k in data.files if k != "version"}

    def save_summed(self, vector: np.ndarray) -> None:
        """Keep the statistics vector a secure fleet's sum now holds of this device: a
        later data version adds only its difference from it. It never leaves the device."""
        atomic_write(self.root / "secure_summed.npz", npz_bytes({"vector": vector}))

    def load_summed(self, length: int) -> np.ndarray:
        """What :meth:`save_summed` kept, or zeros when nothing of this length was summed
        (the fleet's k or classes changed: a new sum)."""
        path = self.root / "secure_summed.npz"
        if path.exists():
            with np.load(path, allow_pickle=False) as data:
                vector = np.asarray(data["vector"], dtype=np.float64)
            if vector.shape == (length,):
                return vector
        return np.zeros(length)

    def save_pending(self, vector: np.ndarray, *, version: str, run: str, round_: int) -> None:
        """Keep the statistics whose secure input is on its way, and which data, run and
        round they are of (edge_agent/secure_join.py). A file of its own, not the snapshot:
        it is written on the protocol's thread, beside the service's."""
        atomic_write(self.root / "secure_pending.npz", npz_bytes({
            "vector": vector, "version": np.array(version), "run": np.array(run),
            "round": np.array(round_),
        }))  # fmt: skip

    def load_pending(self) -> tuple[np.ndarray, str, str, int] | None:
        """What :meth:`save_pending` kept: (vector, version, run, round); None if nothing."""
        path = self.root / "secure_pending.npz"
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as data:
            return (np.asarray(data["vector"], dtype=np.float64), str(data["version"]),
                    str(data["run"]), int(data["round"]))  # fmt: skip

    def load_prototypes(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self._load_pair("prototypes.npz", "prototypes", "counts")

    def _load_pair(
        self, name: str, first: str, second: str
    ) -> tuple[np.ndarray, np.ndarray] | None:
        path = self.root / name
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as data:
            return data[first], data[second]
