"""One device's side of a secure-aggregation round: a state machine over five stages.

Each method takes the coordinator's message for a stage and returns the device's answer;
the transport calls them in order. The device trusts the coordinator with nothing it can
check: the roster must carry its own keys and exactly the neighbours the public graph
gives (:mod:`~secagg.graph`); every relayed ciphertext must come from a neighbour
and open under the pair's key; and it reveals, for each neighbour, the share of its
self-mask seed or the share of its masking key, never both, even across two requests.
Asked the same question twice (a redelivered message), it gives the same answer; asked a
different question for a stage it already answered, it refuses. In a signed fleet
(``enrolment``) every neighbour's keys must also come in that neighbour's advertisement,
signed by the key the fleet CA bound to its id (:mod:`~secagg.enrolled`): keys the
coordinator substituted, or a neighbour it invented, make the device refuse the roster
before any share leaves it.

Devices are numbered ``1..n`` by their place in the roster's sorted list: that number is
each one's Shamir x-coordinate and its id in the masks' key derivation.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from random import Random
from typing import TypeVar

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from protocol import fields as f
from protocol.errors import FieldError
from protocol.ids import validate_id
from secagg.consistency import (
    Consistency,
    Signatures,
    Survivors,
    list_digest,
    roster_digest,
    unsigned_problem,
)
from secagg.enrolled import Enrolment
from secagg.errors import Refused
from secagg.graph import Ring, holder_xs
from secagg.masks import SEED_BYTES, MaskContext, mask_input, pair_secret, seed_commitment
from secagg.messages import (
    Advertise,
    MaskedInput,
    PublicKeys,
    RelayedShares,
    Roster,
    SecAggMessage,
    ShareKeys,
    Stage,
    Unmask,
)
from secagg.noise import device_noise
from secagg.points import small_order
from secagg.quantise import round_scaled, to_ring
from secagg.sealing import pack_pair, pair_context, seal, share_value, unpack_pair, unseal
from secagg.settings import SecAggSettings
from secagg.shamir import Share, split

_ORDER = list(Stage)
M = TypeVar("M", bound=SecAggMessage)


class SecAggDevice:
    """Device ``client``'s part in round ``round`` of ``fleet``. ``rng`` is the secret
    source of its keys, seed, Shamir coefficients, rounding coins and noise: the
    operating system's unless a test injects a seeded one. ``enrolment``: in a signed
    fleet, its enrolled key, certificate and pinned fleet CA, with which it signs its
    advertisement and checks its neighbours'; None in an insecure fleet. ``summed`` and
    ``receipt``: what it knows the fleet's running sum holds of it, which it advertises
    (:class:`~secagg.messages.Advertise`)."""

    def __init__(
        self,
        *,
        client: str,
        fleet: str,
        round: int,
        settings: SecAggSettings,
        rng: Random | None = None,
        enrolment: Enrolment | None = None,
        summed: int = -1,
        receipt: bytes = b"",
    ) -> None:
        self.client = validate_id(client, field="client")
        self._summed, self._receipt = summed, receipt
        if enrolment is not None and enrolment.client != self.client:
            raise ValueError(f"the enrolment is {enrolment.client}'s, not {self.client}'s")
        self._enrolment = enrolment
        self.fleet = validate_id(fleet, field="fleet")
        self.round = f.integer(round, field="round")
        if not isinstance(settings, SecAggSettings):
            raise TypeError(f"expected SecAggSettings, got {type(settings).__name__}")
        self.settings = settings
        self._rng = rng if rng is not None else secrets.SystemRandom()
        # Fresh keys every round: the sealing and mask derivations rely on it.
        self._c = X25519PrivateKey.from_private_bytes(self._rng.randbytes(32))
        self._s = X25519PrivateKey.from_private_bytes(self._rng.randbytes(32))
        self.public = PublicKeys(
            c=self._c.public_key().public_bytes_raw(), s=self._s.public_key().public_bytes_raw()
        )
        self._context = MaskContext(fleet=fleet, round=round)
        # Drawn now, not with the shares: the advertisement commits to it.
        self._seed = self._rng.randbytes(SEED_BYTES)
        self._answers: dict[Stage, tuple[object, SecAggMessage]] = {}
        self._clients: tuple[str, ...] = ()
        self._index: dict[str, int] = {}
        self._roster = b""
        self._neighbours: frozenset[str] = frozenset()
        self._xs: dict[str, int] = {}
        self._keys: Mapping[str, PublicKeys] = {}
        self._held: dict[str, tuple[Share, Share]] = {}
        self._senders: frozenset[str] = frozenset()
        self._certificates: dict[str, bytes] = {}

    def advertise(self) -> Advertise:
        """Stage 1: this round's public keys and the commitment to the self-mask seed."""
        cached = self._begin(Stage.ADVERTISE, None, Advertise)
        if cached is not None:
            return cached
        advert = Advertise(
            fleet=self.fleet,
            round=self.round,
            client=self.client,
            keys=self.public,
            table=self.settings.table,
            commitment=seed_commitment(self._seed, client=self.client, context=self._context),
            summed=self._summed,
            receipt=self._receipt,
        )
        if self._enrolment is not None:
            advert = self._enrolment.sign(advert)
        return self._answer(Stage.ADVERTISE, None, advert)

    def share(self, roster: Roster) -> ShareKeys:
        """Stage 2: check the roster and seal each neighbour's Shamir shares of the
        self-mask seed ``b_u`` and of the masking key ``s_u``."""
        cached = self._begin(Stage.SHARE, roster, ShareKeys)
        if cached is not None:
            return cached
        self._addressed(roster)
        t = self.settings.threshold
        if len(roster.clients) < self.settings.fewest:
            raise self._refuse(
                f"{len(roster.clients)} devices advertised, fewer than {self.settings.least}"
            )
        if roster.keys.get(self.client) != self.public:
            raise self._refuse("the roster does not carry this device's keys")
        ring = Ring(roster.clients, k=self.settings.neighbours, fleet=self.fleet, round=self.round)
        neighbours = ring.row(self.client)
        if set(roster.keys) != neighbours | {self.client}:
            raise self._refuse("the roster's neighbours are not those of the public graph")
        self._check_enrolled(roster, neighbours)
        unsafe = self.settings.unsafe_for(len(neighbours) + 1, len(roster.clients))
        if self._enrolment is not None and unsafe is not None:
            # Unsigned, a coordinator that plays every neighbour unmasks it anyway.
            raise self._refuse(unsafe)
        published = [key for pair in roster.keys.values() for key in (pair.c, pair.s)]
        if len(set(published)) != len(published):
            # Another device advertising this one's key (or a neighbour's) is a replay.
            raise self._refuse("the roster carries one public key twice")
        weak = sorted(
            v for v, pair in roster.keys.items() if small_order(pair.c) or small_order(pair.s)
        )
        if weak:
            # Shares sealed to such a key, or masks agreed with it, are public (secagg/points.py).
            raise self._refuse("a neighbour's public key is of small order", blame=weak[0])
        self._clients = roster.clients
        self._index = {c: i + 1 for i, c in enumerate(roster.clients)}
        self._roster = roster_digest(roster.clients)
        self._neighbours = neighbours
        # Where this device's share of each neighbour's secrets sits (secagg/graph.py).
        self._xs = {v: holder_xs(v, ring.row(v))[self.client] for v in neighbours}
        self._keys = roster.keys
        xs = holder_xs(self.client, neighbours)
        seeds = split(self._seed, threshold=t, holders=sorted(xs.values()), rng=self._rng)
        masks = split(self._s.private_bytes_raw(), threshold=t, holders=sorted(xs.values()),
                      rng=self._rng)  # fmt: skip
        me = xs[self.client]
        self._held = {self.client: (seeds[me], masks[me])}
        sealed = {}
        for v in sorted(neighbours):
            x = xs[v]
            context = pair_context(
                fleet=self.fleet, round=self.round, sender=self.client, recipient=v
            )
            try:
                sealed[v] = seal(
                    pack_pair(seeds[x], masks[x]),
                    private=self._c,
                    peer=self._c_of(v),
                    context=context,
                )
            except ValueError as exc:
                raise self._refuse("its encryption key is a low-order point", blame=v) from exc
        return self._answer(
            Stage.SHARE,
            roster,
            ShareKeys(fleet=self.fleet, round=self.round, client=self.client, ciphertexts=sealed),
        )

    def masked_input(self, relayed: RelayedShares, vector: np.ndarray) -> MaskedInput:
        """Stage 3: keep the shares the neighbours sent, then send ``vector`` (shape
        ``(length,)``) quantised, noised if the fleet says so, and masked with the seed
        and with a pairwise mask for each neighbour that shared keys."""
        values = np.asarray(vector, dtype=np.float64)
        request = (relayed, values.tobytes())
        cached = self._begin(Stage.MASKED_INPUT, request, MaskedInput)
        if cached is not None:
            return cached
        self._addressed(relayed)
        if values.shape != (self.settings.length,):
            raise ValueError(f"vector shape {values.shape} is not ({self.settings.length},)")
        senders = frozenset(relayed.ciphertexts)
        strangers = sorted(senders - self._neighbours)
        if strangers:
            raise self._refuse(
                "relayed shares from a device that is not a neighbour", blame=strangers[0]
            )
        t = self.settings.threshold
        if len(senders) + 1 < t:
            # Masked with fewer, this input would sit in a neighbourhood too small for t.
            raise self._refuse(f"only {len(senders)} neighbours shared keys; t = {t}")
        me = self._index[self.client]
        held = dict(self._held)
        for v, ciphertext in relayed.ciphertexts.items():
            context = pair_context(
                fleet=self.fleet, round=self.round, sender=v, recipient=self.client
            )
            try:
                plain = unseal(ciphertext, private=self._c, peer=self._c_of(v), context=context)
                held[v] = unpack_pair(plain, x=self._xs[v], threshold=t)
            except (InvalidTag, ValueError) as exc:
                raise self._refuse("its shares do not open under the pair's key", blame=v) from exc
        x = self._encode(values)
        try:
            pairs = {self._index[v]: pair_secret(self._s, self._s_of(v)) for v in senders}
        except ValueError as exc:
            raise self._refuse("a neighbour's masking key is a low-order point") from exc
        y = mask_input(x, me=me, self_seed=self._seed, pair_secrets=pairs, context=self._context)
        self._held, self._senders = held, senders
        answer = MaskedInput(
            fleet=self.fleet,
            round=self.round,
            client=self.client,
            bits=self.settings.spec.bits,
            masked=y.tobytes(),
        )
        return self._answer(Stage.MASKED_INPUT, request, answer)

    def consistency(self, survivors: Survivors) -> Consistency:
        """Stage 4: check the survivor list and sign it; no share leaves yet."""
        try:
            names = survivors.listed(self._clients)
        except FieldError as exc:
            raise self._refuse(f"its survivor marks do not fit the roster ({exc})") from exc
        listed = frozenset(names)
        keys = self._senders - listed
        flipped = sorted(
            v for v, kind in self._revealed().items() if (v in keys) != (kind == "key")
        )
        if flipped:
            raise self._refuse("asked for both shares of a device", blame=flipped[0])
        cached = self._begin(Stage.CONSISTENCY, survivors, Consistency)
        if cached is not None:
            return cached
        self._addressed(survivors)
        strangers = sorted(listed - set(self._index))
        if strangers:
            raise self._refuse("a survivor is not in the roster", blame=strangers[0])
        if self.client not in listed:
            raise self._refuse("this device is not among the survivors")
        if len(listed) < self.settings.fewest:
            raise self._refuse(f"{len(listed)} survivors, fewer than {self.settings.least}")
        silent = sorted((listed & self._neighbours) - self._senders)
        if silent:
            raise self._refuse("a survivor never shared keys with this device", blame=silent[0])
        answer = Consistency(fleet=self.fleet, round=self.round, client=self.client,
                             listed=list_digest(names), roster=self._roster)  # fmt: skip
        if self._enrolment is not None:
            answer = self._enrolment.sign(answer)
        return self._answer(Stage.CONSISTENCY, survivors, answer)

    def unmask(self, signatures: Signatures) -> Unmask:
        """Stage 5, once ``T`` survivors signed the list this device holds: the share of
        ``b_v`` for each neighbour ``v`` (and itself) whose input is in the sum, the share
        of ``s_v`` for each that shared keys and then dropped."""
        cached = self._begin(Stage.UNMASK, signatures, Unmask)
        if cached is not None:
            return cached
        self._addressed(signatures)
        held = self._answers[Stage.CONSISTENCY][0]
        assert isinstance(held, Survivors)
        problem = unsigned_problem(
            signatures, survivors=held.listed(self._clients), roster=self._roster, fleet=self.fleet,
            round=self.round,
            threshold=self.settings.fewest, enrolment=self._enrolment,
            least=self.settings.least, certificates=self._certificates, client=self.client,
            devices=len(self._index), colluding=self.settings.colluding,
        )  # fmt: skip
        if problem is not None:
            raise self._refuse(problem[0], blame=problem[1])
        if not signatures.marks and self.client not in signatures.signed:
            raise self._refuse("its own signed survivor list is not among the signatures")
        listed = frozenset(held.listed(self._clients))
        seeds = sorted((self._senders & listed) | {self.client})
        keys = sorted(self._senders - listed)
        answer = Unmask(
            fleet=self.fleet,
            round=self.round,
            client=self.client,
            seed_shares={v: share_value(self._held[v][0]) for v in seeds},
            key_shares={v: share_value(self._held[v][1]) for v in keys},
        )
        return self._answer(Stage.UNMASK, signatures, answer)

    def _check_enrolled(self, roster: Roster, neighbours: frozenset[str]) -> None:
        """In a signed fleet, refuses unless every neighbour's keys come in its own
        advertisement, signed under a certificate of the pinned fleet CA."""
        if self._enrolment is None:
            return
        certificates = {self.client: self._enrolment.certificate}
        for v in sorted(neighbours):
            advert = self._enrolment.vouched(
                roster.adverts.get(v), client=v, fleet=self.fleet, round=self.round,
                keys=roster.keys[v],
            )  # fmt: skip
            if isinstance(advert, str):
                raise self._refuse(f"a neighbour's advertisement {advert}", blame=v)
            certificates[v] = advert.certificate
        # Kept to check their signed survivor lists with (secagg/consistency.py).
        self._certificates = certificates

    def _revealed(self) -> dict[str, str]:
        """Which share of each device this one has already given: "seed" or "key"."""
        if Stage.UNMASK not in self._answers:
            return {}
        given = self._answers[Stage.UNMASK][1]
        assert isinstance(given, Unmask)
        return {
            **dict.fromkeys(given.seed_shares, "seed"),
            **dict.fromkeys(given.key_shares, "key"),
        }

    def _encode(self, values: np.ndarray) -> np.ndarray:
        spec = self.settings.spec
        q = round_scaled(values, spec=spec, rng=self._rng)
        if self.settings.sigma2 is not None:
            noise = device_noise(
                q.size,
                sigma2=self.settings.sigma2,
                threshold=self.settings.fewest,
                rng=self._rng,
            )
            q = q + noise
        return to_ring(q, bits=spec.bits)

    def _begin(self, stage: Stage, request: object, kind: type[M]) -> M | None:
        """The answer already given to this very request, or None to compute one; refuses
        a stage out of order or a second, different request for one."""
        if stage in self._answers:
            asked, given = self._answers[stage]
            if _same(asked, request):
                assert isinstance(given, kind)
                return given
            raise self._refuse(f"already answered the {stage.value} stage differently")
        earlier = _ORDER[: _ORDER.index(stage)]
        if any(s not in self._answers for s in earlier):
            raise self._refuse(f"the {stage.value} stage comes before the previous one ended")
        return None

    def _answer(self, stage: Stage, request: object, answer: M) -> M:
        self._answers[stage] = (request, answer)
        return answer

    def _addressed(self, message: SecAggMessage) -> None:
        if (message.fleet, message.round, message.client) != (self.fleet, self.round, self.client):
            raise self._refuse(
                f"a message for {message.client} in round {message.round} of {message.fleet}"
            )

    def _c_of(self, v: str) -> X25519PublicKey:
        return X25519PublicKey.from_public_bytes(self._keys[v].c)

    def _s_of(self, v: str) -> X25519PublicKey:
        return X25519PublicKey.from_public_bytes(self._keys[v].s)

    def _refuse(self, why: str, *, blame: str | None = None) -> Refused:
        about = f" ({blame})" if blame else ""
        return Refused(f"{self.client} refuses: {why}{about}", round=self.round, client=blame)


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
