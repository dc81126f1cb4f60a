"""How a fleet run shows its progress: tqdm bars on a terminal, a log line per round."""

from __future__ import annotations

import logging
import sys
from typing import Any

from fleet.transports.spec import RunSpec

log = logging.getLogger(__name__)


def progress_bar(spec: RunSpec, total: int, desc: str, unit: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        leave=False,
        disable=not spec.progress or None,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def log_round(spec: RunSpec, done: int) -> None:
    # Progress bars are off when stderr is no terminal (CI, journald, a test); this line
    # (shown with --log-level INFO) tells such a reader how far the run is.
    log.info("%s: round %d of %d closed", spec.method, done, spec.rounds)
