"""The coordinator's side of a secure-aggregation round: collect, relay, check, unmask.

Transport-free: the caller hands in each device message as it arrives (``take_*``) and
closes each stage when its deadline passes (``close_*``), which returns what to send each
device next. Whoever has not answered by then has dropped; the round goes on while at
least ``T`` devices remain and aborts with :class:`~secagg.errors.RoundAborted` (naming
the stage and the reason) otherwise, or when too few shares of some secret come back.

What the coordinator holds is never a device's input: the masked inputs are added into one
running sum as they arrive, and the last stage rebuilds the self-mask seed ``b_u`` of the
survivors and the masking key ``s_v`` of the devices that dropped after sharing keys, the
two sets disjoint, which the devices enforce too. The unmasked sum is the only plain
number it ever computes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Iterable, Mapping
from types import MappingProxyType
from typing import NoReturn

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from protocol import fields as f
from protocol.ids import validate_id
from secagg.consistency import Consistency, Signatures, Survivors, list_digest, relayed
from secagg.errors import Excluded, Refused, RoundAborted
from secagg.evidence import marks_of
from secagg.graph import HolderXs, neighbour_graph
from secagg.masks import MaskContext, pair_secret, ring_add, ring_dtype, seed_commitment, unmask_sum
from secagg.messages import (
    Abort,
    Advertise,
    Close,
    MaskedInput,
    PublicKeys,
    RelayedShares,
    Roster,
    SecAggMessage,
    ShareKeys,
    Stage,
    Unmask,
)
from secagg.points import small_order
from secagg.quantise import decode
from secagg.result import SecAggResult
from secagg.sealing import SECRET_BYTES
from secagg.settings import SecAggSettings
from secagg.shamir import P521, combine_points


class SecAggServer:
    """Round ``round`` of ``fleet`` as the coordinator runs it."""

    def __init__(self, *, fleet: str, round: int, settings: SecAggSettings) -> None:
        self.fleet = validate_id(fleet, field="fleet")
        self.round = f.integer(round, field="round")
        if not isinstance(settings, SecAggSettings):
            raise TypeError(f"expected SecAggSettings, got {type(settings).__name__}")
        self.settings = settings
        self.stage: Stage | None = Stage.ADVERTISE
        self.aborted: RoundAborted | None = None
        self._context = MaskContext(fleet=fleet, round=round)
        self._keys: dict[str, PublicKeys] = {}
        self._published: set[bytes] = set()  # every advertised key, for the replay check
        self._commitments: dict[str, bytes] = {}
        self._signed: dict[str, bytes] = {}
        self._certificates: dict[str, bytes] = {}
        self._clients: tuple[str, ...] = ()
        self._index: dict[str, int] = {}
        self._graph: Mapping[str, frozenset[str]] = {}
        self._shares: dict[str, ShareKeys] = {}
        self._digests: dict[str, bytes] = {}
        self._sum = np.zeros(settings.length, dtype=ring_dtype(settings.spec.bits))
        self._consistent: dict[str, bytes] = {}
        self._listed, self._xs = b"", HolderXs({})
        self._unmasks: dict[str, Unmask] = {}
        self._seed_shares: dict[str, list[tuple[int, int]]] = {}  # owner -> (x, y)
        self._key_shares: dict[str, list[tuple[int, int]]] = {}
        self._dropped: dict[Stage, tuple[str, ...]] = {}

    # Stage 1: key advertisement.

    def take_advertise(self, message: Advertise) -> None:
        self._open(Stage.ADVERTISE, message)
        u = message.client
        taken = (self._keys[u], self._commitments[u]) if u in self._keys else None
        if self._repeat(taken, (message.keys, message.commitment), u):
            return
        if message.table != self.settings.table:
            # Another table adds other noise, or masks in another ring: its sum is wrong.
            theirs = message.table.hex()[:8] or "none"
            raise self._exclude(
                f"its [secure_aggregation] table differs from the coordinator's (digest "
                f"{theirs}, not {self.settings.table.hex()[:8] or 'none'})",
                message.client,
            )
        if {message.keys.c, message.keys.s} & self._published:
            # A key another device already advertised: a replay under a second name.
            raise self._refuse("advertised a key another device already holds", message.client)
        if small_order(message.keys.c) or small_order(message.keys.s):
            # Its neighbours would refuse the roster, and the round abort (secagg/points.py).
            raise self._exclude("advertised a public key of small order", message.client)
        if not message.commitment:
            raise self._exclude("advertised no commitment to its self-mask seed", message.client)
        self._keys[message.client] = message.keys
        self._published |= {message.keys.c, message.keys.s}
        self._commitments[message.client] = message.commitment
        if message.auth is not None:
            # Relayed as signed: the neighbours check it, not this server (secagg/enrolled.py).
            self._signed[message.client] = message.to_wire()
        if message.certificate:  # relayed to the non-neighbours that check its signed list
            self._certificates[message.client] = message.certificate

    def close_advertise(self) -> dict[str, Roster]:
        """Each advertiser's roster: the sorted list of all of them, and the keys of it and
        its neighbours, with the neighbours' signed advertisements."""
        self._open(Stage.ADVERTISE)
        clients = tuple(sorted(self._keys))
        self._enough(Stage.ADVERTISE, len(clients), "devices advertised keys")
        if not self.settings.fits(len(clients)):
            bits = self.settings.spec.bits
            self._abort(
                Stage.ADVERTISE, f"{len(clients)} inputs could overflow the {bits}-bit ring"
            )
        self._clients = clients
        self._index = {c: i + 1 for i, c in enumerate(clients)}
        self._graph = neighbour_graph(
            clients, k=self.settings.neighbours, fleet=self.fleet, round=self.round
        )
        self._xs = HolderXs(self._graph)
        unsafe = self.threshold_problem()
        if unsafe is not None:
            self._abort(Stage.ADVERTISE, unsafe)
        self.stage = Stage.SHARE
        return {
            u: Roster(
                fleet=self.fleet,
                round=self.round,
                client=u,
                clients=clients,
                keys={v: self._keys[v] for v in self._graph[u] | {u}},
                adverts={v: self._signed[v] for v in self._graph[u] if v in self._signed},
            )
            for u in clients
        }

    # Stage 2: sharing keys.

    def take_share(self, message: ShareKeys) -> None:
        self._open(Stage.SHARE, message, among=self._index)
        if self._repeat(self._shares.get(message.client), message, message.client):
            return
        if set(message.ciphertexts) != self._graph[message.client]:
            raise self._refuse("did not share with exactly its neighbours", message.client)
        self._shares[message.client] = message

    def close_share(self) -> dict[str, RelayedShares]:
        """For each device that shared, the ciphertexts its neighbours addressed to it."""
        self._open(Stage.SHARE)
        self._dropped[Stage.SHARE] = self._left(self._clients, self._shares)
        self._enough(Stage.SHARE, len(self._shares), "devices shared keys")
        self.stage = Stage.MASKED_INPUT
        # Each sharer addressed exactly its neighbours (take_share), and the graph is
        # symmetric: u's inbox is what its neighbours that shared sent it. Filled sender by
        # sender, one pass over two million ciphertexts at 10,000 devices.
        inbox: dict[str, dict[str, bytes]] = {u: {} for u in self._shares}
        for v, message in self._shares.items():
            for u, ciphertext in message.ciphertexts.items():
                if u in inbox:
                    inbox[u][v] = ciphertext
        return {
            u: RelayedShares(fleet=self.fleet, round=self.round, client=u, ciphertexts=inbox[u])
            for u in sorted(self._shares)
        }

    # Stage 3: masked inputs.

    def take_masked_input(self, message: MaskedInput) -> None:
        self._open(Stage.MASKED_INPUT, message, among=self._shares)
        digest = hashlib.sha256(message.masked).digest()
        if self._repeat(self._digests.get(message.client), digest, message.client):
            return
        vector = message.vector()
        if message.bits != self.settings.spec.bits or vector.size != self.settings.length:
            raise self._refuse(
                f"sent {vector.size} {message.bits}-bit words, not {self.settings.length} "
                f"of {self.settings.spec.bits} bits",
                message.client,
            )
        self._digests[message.client] = digest
        self._sum = ring_add(self._sum, vector)

    def close_masked_input(self) -> dict[str, Survivors]:
        """For each device whose masked input is in the sum, the list of all of them."""
        self._open(Stage.MASKED_INPUT)
        self._dropped[Stage.MASKED_INPUT] = self._left(self._shares, self._digests)
        self._enough(Stage.MASKED_INPUT, len(self._digests), "devices sent masked inputs")
        self.stage = Stage.CONSISTENCY
        self._listed = list_digest(tuple(sorted(self._digests)))  # what survivors sign
        # Marks over the roster: a byte for eight devices in place of their ids.
        marks = marks_of(self._clients, self._digests)
        return {u: Survivors(fleet=self.fleet, round=self.round, client=u, marks=marks)
                for u in sorted(self._digests)}  # fmt: skip

    # Stage 4: the survivors sign the list (secagg/consistency.py).

    def take_consistency(self, message: Consistency) -> None:
        u = message.client
        self._open(Stage.CONSISTENCY, message, among=self._digests)
        payload = message.to_wire()
        if self._repeat(self._consistent.get(u), payload, u):
            return
        if message.listed != self._listed:
            raise self._refuse("signed another survivor list than it was sent", u)
        self._consistent[u] = payload

    def close_consistency(self) -> dict[str, Signatures]:
        """For each survivor that signed the list, the evidence: every survivor's signed
        list, or the compact form where that is smaller (secagg/consistency.py)."""
        self._open(Stage.CONSISTENCY)
        self._dropped[Stage.CONSISTENCY] = self._left(self._digests, self._consistent)
        self._enough(Stage.CONSISTENCY, len(self._consistent), "devices signed the survivors")
        self.stage = Stage.UNMASK
        return relayed(fleet=self.fleet, round=self.round, survivors=tuple(sorted(self._digests)),
                       signed=self._consistent, certificates=self._certificates,
                       graph=self._graph, settings=self.settings, devices=len(self._clients))  # fmt: skip

    # Stage 5: unmasking.

    def take_unmask(self, message: Unmask) -> None:
        u = message.client
        self._open(Stage.UNMASK, message, among=self._consistent)
        if self._repeat(self._unmasks.get(u), message, u):
            return
        shared = {v for v in self._graph[u] if v in self._shares}
        seeds = {v for v in shared if v in self._digests} | {u}
        if set(message.seed_shares) != seeds or set(message.key_shares) != shared - seeds:
            raise self._refuse("did not give exactly the shares the survivors call for", u)
        parsed = [
            (pool, v, int.from_bytes(value, "big"))
            for pool, given in ((self._seed_shares, message.seed_shares),
                                (self._key_shares, message.key_shares))
            for v, value in given.items()
        ]  # fmt: skip
        if any(y >= P521 for _, _, y in parsed):
            raise self._refuse("gave a share outside the field", u)
        self._unmasks[u] = message
        for pool, v, y in parsed:
            pool.setdefault(v, []).append((self._xs[v][u], y))

    def close_unmask(self) -> SecAggResult:
        """Rebuild the survivors' seeds and the dropped devices' masking keys, remove what
        did not cancel, and decode the survivors' sum."""
        self._open(Stage.UNMASK)
        self._dropped[Stage.UNMASK] = self._left(self._consistent, self._unmasks)
        self._enough(Stage.UNMASK, len(self._unmasks), "devices sent their shares")
        survivors = sorted(self._digests)
        dropped = sorted(set(self._shares) - set(self._digests))
        # Each device's input is hidden by b_u and by s_u; rebuild one or the other, never both.
        assert not set(survivors) & set(dropped)
        seeds = {}
        for u in survivors:
            seed = self._rebuild(u, self._seed_shares, "self-mask seed")
            # With exactly t shares a wrong one still interpolates: only the commitment
            # tells that the seed is not u's, which would silently spoil the sum.
            if seed_commitment(seed, client=u, context=self._context) != self._commitments[u]:
                self._abort(
                    Stage.UNMASK,
                    f"the rebuilt self-mask seed of {u} is not the one it committed to",
                )
            seeds[self._index[u]] = seed
        dangling: dict[tuple[int, int], bytes] = {}
        for v in dropped:
            partners = sorted(self._graph[v] & set(survivors))
            if not partners:
                continue
            key = X25519PrivateKey.from_private_bytes(
                self._rebuild(v, self._key_shares, "masking key")
            )
            if key.public_key().public_bytes_raw() != self._keys[v].s:
                self._abort(
                    Stage.UNMASK, f"the rebuilt masking key of {v} is not the one it advertised"
                )
            for u in partners:
                peer = X25519PublicKey.from_public_bytes(self._keys[u].s)
                dangling[(self._index[u], self._index[v])] = pair_secret(key, peer)
        total = unmask_sum(self._sum, self_seeds=seeds, dangling=dangling, context=self._context)
        self.stage = None
        return SecAggResult(
            total=decode(total, spec=self.settings.spec),
            survivors=tuple(survivors),
            dropped=MappingProxyType(dict(self._dropped)),
        )

    def close_messages(self) -> dict[str, Close]:
        """After the sum is unmasked, the close for every device that advertised keys:
        whether its input is in the sum (its masked input arrived)."""
        if self.stage is not None or self.aborted is not None:
            raise ValueError(f"round {self.round} has not closed")
        return {
            u: Close(fleet=self.fleet, round=self.round, client=u, summed=u in self._digests)
            for u in sorted(self._keys)
        }

    def abort_messages(self) -> dict[str, Abort]:
        """After an abort, the notice for every device that advertised keys."""
        if self.aborted is None:
            raise ValueError(f"round {self.round} has not aborted")
        stage, why = Stage(self.aborted.stage), self.aborted.why
        return {
            u: Abort(fleet=self.fleet, round=self.round, client=u, stage=stage, reason=why)
            for u in sorted(self._keys)
        }

    @property
    def dropped(self) -> Mapping[Stage, tuple[str, ...]]:
        """Who failed to answer each stage closed so far."""
        return MappingProxyType(dict(self._dropped))

    def _rebuild(self, owner: str, pool: Mapping[str, list[tuple[int, int]]], what: str) -> bytes:
        shares = pool.get(owner, [])
        t = self.settings.threshold
        if len(shares) < t:
            self._abort(
                Stage.UNMASK,
                f"{len(shares)} shares of the {what} of {owner} came back, fewer than t = {t}",
            )
        try:
            return combine_points(shares, threshold=t, size=SECRET_BYTES)
        except ValueError as exc:
            self._abort(Stage.UNMASK, f"the shares of the {what} of {owner} disagree", cause=exc)

    def _open(
        self,
        stage: Stage,
        message: SecAggMessage | None = None,
        among: Container[str] | None = None,
    ) -> None:
        """Refuse unless ``stage`` is the open one and ``message`` is for this round and
        from a device still in it (one of ``among``)."""
        if self.aborted is not None:
            raise self.aborted
        if self.stage is not stage:
            now = "over" if self.stage is None else f"at {self.stage.value}"
            raise Refused(
                f"the round is {now}, not at {stage.value}",
                round=self.round,
                client=None if message is None else message.client,
            )
        if message is None:
            return
        if (message.fleet, message.round) != (self.fleet, self.round):
            raise self._refuse(
                f"sent a message for round {message.round} of {message.fleet}", message.client
            )
        if among is not None and message.client not in among:
            raise self._refuse("is not in the round at this stage", message.client)

    def _repeat(self, before: object, now: object, client: str) -> bool:
        """True for a redelivered message; refuses a second, different one."""
        if before is None:
            return False
        if before == now:
            return True
        raise self._refuse("sent a second, different message for this stage", client)

    def threshold_problem(self) -> str | None:
        """Why enrolled devices (their advertisements carry certificates) would each
        refuse this round's rosters (secagg/device.py), if they would."""
        h = max(map(len, self._graph.values())) + 1
        return self.settings.unsafe_for(h, len(self._clients)) if self._certificates else None

    def _enough(self, stage: Stage, count: int, what: str) -> None:
        if count < self.settings.fewest:
            self._abort(stage, f"{count} {what}, fewer than the {self.settings.least_named}")

    def _abort(self, stage: Stage, why: str, *, cause: Exception | None = None) -> NoReturn:
        self.aborted = RoundAborted(why, round=self.round, stage=stage.value)
        self.stage = None
        raise self.aborted from cause

    @staticmethod
    def _left(before: Iterable[str], after: Mapping[str, object]) -> tuple[str, ...]:
        return tuple(sorted(set(before) - set(after)))

    def _exclude(self, why: str, client: str) -> Excluded:
        return Excluded(why, round=self.round, client=client)

    def _refuse(self, why: str, client: str) -> Refused:
        return Refused(f"{client} {why}", round=self.round, client=client)
