"""Secure aggregation, a protocol of its own beside protocol/ (its own messages, topics
and stages): the server learns the fleet's noised sum, never a device's input.

The protocol (Bonawitz et al., CCS 2017; SecAgg+ of Bell et al., CCS 2020 when each device
pairs with a sparse set of neighbours rather than all) runs in five stages per round, each
over MQTT once it is wired in. This package holds the pure pieces they are built of and
the two sides' state machines, transport-free: :class:`~secagg.device.SecAggDevice`
and :class:`~secagg.server.SecAggServer`, exchanging the messages of
:mod:`~secagg.messages` over a neighbour graph drawn from a public seed
(:mod:`~secagg.graph`):

1. Key advertisement: each device publishes two X25519 public keys, one to encrypt the
   shares it sends (an AEAD under an HKDF-derived key) and one for pairwise masks, none of
   small order (:mod:`~secagg.points`); the digest of its ``[secure_aggregation]`` table;
   and a commitment to the 32-byte self-mask seed ``b_u`` it draws
   (:func:`~secagg.masks.seed_commitment`). In a signed fleet it signs the advertisement
   with its enrolled key and sends its certificate from the fleet CA; the roster relays
   each neighbour's signed advertisement, and a device takes a neighbour's keys only under
   that CA's certificate for the neighbour's id (:mod:`~secagg.enrolled`).
2. Share keys: each device splits ``b_u`` and its mask private key into Shamir shares for
   its neighbours, threshold ``t`` (:mod:`~secagg.shamir`).
3. Masked input: each device clips, scales and rounds its vector
   (:mod:`~secagg.quantise`), adds its share of the distributed discrete Gaussian
   noise in the integer domain (:mod:`~secagg.noise`), maps it into ``Z_{2^k}``
   and adds its self mask and pairwise masks (:mod:`~secagg.masks`).
4. Consistency: each survivor signs the survivor list it was sent, and no device
   releases a share before ``t`` survivors signed the very list it holds
   (:mod:`~secagg.consistency`).
5. Unmasking: the survivors send, for every neighbour, the share of its seed ``b_u`` if it
   survived or of its mask key if it dropped; the server rebuilds them
   (:func:`~secagg.shamir.combine`), checks them against the advertised commitment and
   public key, removes the masks that did not cancel
   (:func:`~secagg.masks.unmask_sum`) and decodes the noised sum
   (:func:`~secagg.quantise.decode`).

The threshold ``t``, the neighbour count, the ring width, the clip bound, the scale and the
noise parameter are public fleet settings (:mod:`~secagg.settings`). Imports:
numpy, msgpack, ``cryptography``, the standard library and the wire conventions of
``protocol/`` (the stage messages are signable like every other message). Over MQTT, signed, the
rounds run through :mod:`~secagg.mqtt` (topics ``secagg/up`` and ``secagg/down``,
docs/protocol.md) with :mod:`~secagg.wire` checking every message; a fleet's
rounds use them through :mod:`~secagg.fleet` (coordinator/rounds/secure_rounds.py, the
agent's service). Against a coordinator that shows devices different survivor lists, a
signed device refuses a threshold under which its holders could give t shares of both of
its secrets (``2t <= h + c``, :mod:`~secagg.device`), and the consistency stage makes
every device that releases a share hold the list ``t`` survivors signed (docs/privacy.md
says what is left open on a sparse graph).
"""
