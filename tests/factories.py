"""Valid example messages shared by the protocol tests, benchmarks and fuzz corpus."""

from __future__ import annotations

import numpy as np

from protocol import AgentState, PrivacyMeta, PrototypeUpdate, RoundAnnouncement, Status


def _grid(rows: int, cols: int, dtype: type) -> np.ndarray:
    # Exactly representable values so the golden bytes do not depend on rounding.
    return (np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) / 8.0).astype(dtype)


def update(**overrides: object) -> PrototypeUpdate:
    fields: dict[str, object] = dict(
        fleet="lab",
        round=3,
        client="jetson-01",
        bundle="b" * 64,
        method="fedpcl",
        classes=(0, 2, 5),
        counts=(4, 7, 1),
        prototypes=_grid(3, 4, np.float16),
        extras={"fisher": _grid(3, 4, np.float32)},
        privacy=PrivacyMeta(
            mechanism="dp",
            epsilon=1.5,
            delta=1e-5,
            guarantee="(epsilon, delta)-DP, add/remove one example",
        ),
    )
    fields.update(overrides)
    return PrototypeUpdate(**fields)  # type: ignore[arg-type]


#: The coordinator run the factories' messages name.
RUN = "0123456789abcdef"


def announcement(**overrides: object) -> RoundAnnouncement:
    fields: dict[str, object] = dict(
        fleet="lab",
        round=4,
        run=RUN,
        run_started=1_799_999_000.25,
        bundle="b" * 64,
        method="fedpcl",
        classes=("zero", "one", "two"),
        dim=4,
        deadline=1_800_000_000.5,
        params={"tau": 0.07, "epochs": 1, "paper_weights": False, "loss": "fedpcl"},
        global_classes=(0, 2),
        global_prototypes=_grid(2, 4, np.float16),
        local_sets={"jetson-01": _grid(2, 4, np.float16), "jetson-02": _grid(2, 4, np.float16)},
    )
    fields.update(overrides)
    return RoundAnnouncement(**fields)  # type: ignore[arg-type]


def status(**overrides: object) -> Status:
    fields: dict[str, object] = dict(
        fleet="lab",
        client="jetson-01",
        state=AgentState.OFFLINE,
        version="0.1.0",
        last_round=3,
        reason="connection lost",
        run=RUN,
    )
    fields.update(overrides)
    return Status(**fields)  # type: ignore[arg-type]
