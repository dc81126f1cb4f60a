"""A bounded downlink: the round announcement stays within a byte budget whatever the
fleet's size, and one the devices would drop is never published.

FedPCL's local term (Eq. 7) is ``L_p = (1/m) sum_{p=1..m} l_p``, the contrastive term
against each of the m clients' padded local sets. Sending all m sets makes the one retained
announcement, and so every device's download, grow with the fleet: 10 kB a client at 256-d
float32, past a device's payload cap at a few hundred clients. Instead the coordinator sends
k sets, the most that fit ``model.downlink_budget`` bytes (but at least :data:`MIN_SETS`,
so a fleet of that many clients is always exact), chosen uniformly at random without
replacement. Each client is then sent with probability k/m, so the device's plain average
over the sets it receives, ``(1/k) sum_{p in S} l_p``, has expectation
``(1/k) sum_p (k/m) l_p = L_p``: the same local term in expectation (and its gradient, which
is linear in the l_p), with no weights on the wire and no change on the device. The sample
is drawn afresh every round from a seed of public values (fleet and round), so anyone can
check which sets were sent and every client's set is used over the rounds.

When every set fits, nothing is sampled: the announcement is exactly the unbounded one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from runtime.cliutil import CommandFailed

#: ``model.downlink_budget``'s default: an announcement of at most 64 KiB. At 256-d and 10
#: classes that is 11 local sets in float16 or 5 in float32 beside the global set.
DEFAULT_BUDGET = 64 << 10

#: The fewest local sets a sampled announcement carries, whatever the budget: a fleet of at
#: most this many clients always gets the exact announcement (wide prototypes, such as
#: dp-features' 896-d backbone features at 36 kB a set, would otherwise get one set a round
#: even in a 5-device fleet). Still a bound independent of the fleet's size.
MIN_SETS = 5


def key_bytes(client: str) -> int:
    """Bytes msgpack spends on ``client`` as a map key: a safe id is ASCII of at most 64
    characters, a fixstr (one byte of header) up to 31 and a str8 (two) beyond."""
    n = len(client.encode())
    return n + (1 if n < 32 else 2 if n < 256 else 3)


def map_header_bytes(entries: int) -> int:
    """msgpack's map header: a fixmap up to 15 entries, map16 up to 65,535, map32 beyond."""
    return 1 if entries < 16 else 3 if entries < 1 << 16 else 5


def encoded_bytes(*, rest: int, array_bytes: int, clients: Sequence[str]) -> int:
    """The announcement's size carrying these clients' local sets, from ``rest``, its size
    with an empty ``local_sets`` map, and ``array_bytes``, one set's encoded array."""
    entries = sum(key_bytes(c) + array_bytes for c in clients)
    return rest - map_header_bytes(0) + map_header_bytes(len(clients)) + entries


def sets_that_fit(*, budget: int, rest: int, array_bytes: int, clients: Sequence[str]) -> int:
    """How many of ``clients``' local sets an announcement of at most ``budget`` bytes
    carries: all of them when the exact announcement fits; otherwise the most k for which
    any k of them fit, each counted at the longest client id (0 when not even one does)."""
    if encoded_bytes(rest=rest, array_bytes=array_bytes, clients=clients) <= budget:
        return len(clients)
    per_set = array_bytes + max(key_bytes(c) for c in clients)
    # The header of the full map bounds that of any smaller one.
    room = budget - rest + map_header_bytes(0) - map_header_bytes(len(clients))
    return max(0, room // per_set)


def round_seed(fleet: str, round_: int) -> int:
    """The sample's seed: a hash of public values, the same in every process."""
    digest = hashlib.sha256(f"{fleet}/{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def sample_clients(clients: Sequence[str], k: int, *, seed: int) -> tuple[str, ...]:
    """``k`` of ``clients`` uniformly at random without replacement (all of them when ``k``
    is not smaller), in sorted order. The clients are sorted first, so the sample depends on
    which clients there are and the seed, never on the order their updates arrived in."""
    ordered = sorted(clients)
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    if k >= len(ordered):
        return tuple(ordered)
    picked = np.random.default_rng(seed).choice(len(ordered), size=k, replace=False)
    return tuple(ordered[i] for i in sorted(picked))


class AnnouncementRefused(CommandFailed):
    """The coordinator will not publish round ``round``'s announcement: it would be
    ``size`` bytes against ``limit``, the value of ``setting``. The service exits with this
    one line (status 1) rather than publish what every device would drop: a fleet that never
    receives its round otherwise waits for ever, and says nothing."""

    def __init__(self, *, round_: int, size: int, limit: int, setting: str, remedy: str) -> None:
        self.round = round_
        self.size = size
        self.limit = limit
        self.setting = setting
        super().__init__(
            f"round {round_}: refusing to publish an announcement of {size:,} bytes, above "
            f"{setting} = {limit:,}; {remedy}"
        )
