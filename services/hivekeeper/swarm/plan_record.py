"""The averaging plan as a DHT record: signed by the balancer's libp2p key, with an expiry.

Anyone can write to the DHT, so peers follow a plan only if it is signed by the key whose
peer ID the topology gave them (`--plan-signer`, known before the balancer starts, like the
backbone's). The record carries the signer's public key; a peer checks that it hashes to the
expected peer ID (libp2p's rule for RSA keys) and that the signature covers the payload, and
drops plans that expired or name another swarm. Every failure is a `PlanRecordError` with a
reason: a forged or garbled record costs the peer nothing but a log line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

PLAN_SUFFIX = "_plan"
FORMAT_VERSION = 1
_PADDING = padding.PKCS1v15()
_HASH = hashes.SHA256()


class PlanRecordError(ValueError):
    """A plan record that must not be followed, and why."""


@dataclass(frozen=True)
class PeerAssignment:
    peer_id: str
    name: str
    computes_gradients: bool
    share: float


@dataclass(frozen=True)
class SignedPlan:
    """What the balancer decided, as peers see it once verified."""

    swarm: str
    digest: str  # names the shares (PlannedAverager's plan_digest): unchanged by a renewal
    issued: float  # DHT time
    expires: float
    steps_per_second: float
    compute_bound: float
    aggregation_bound: float
    averaging_seconds: float
    group_size: int
    peers: tuple[PeerAssignment, ...]
    # the predicted step split into compute, transfer and fixed parts (planning/step_time.py);
    # None until the peers have measured their steps: steps_per_second is then the LP's alone
    step: Optional[dict[str, Any]] = None

    def shares(self) -> dict[str, float]:
        return {peer.peer_id: peer.share for peer in self.peers}

    def assignment(self, peer_id: str) -> Optional[PeerAssignment]:
        return next((peer for peer in self.peers if peer.peer_id == peer_id), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION, "swarm": self.swarm, "digest": self.digest, "issued": self.issued,
            "expires": self.expires, "stepsPerSecond": self.steps_per_second, "computeBound": self.compute_bound,
            "aggregationBound": self.aggregation_bound, "averagingSeconds": self.averaging_seconds,
            "groupSize": self.group_size, "step": self.step,
            "peers": [{"peerId": p.peer_id, "name": p.name, "computesGradients": p.computes_gradients,
                       "share": p.share} for p in self.peers],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SignedPlan":
        try:
            if data["version"] != FORMAT_VERSION:
                raise PlanRecordError(f"plan format {data['version']!r}, this peer reads {FORMAT_VERSION}")
            peers = tuple(PeerAssignment(str(p["peerId"]), str(p["name"]), bool(p["computesGradients"]),
                                         float(p["share"])) for p in data["peers"])
            return cls(swarm=str(data["swarm"]), digest=str(data["digest"]), issued=float(data["issued"]),
                       expires=float(data["expires"]), steps_per_second=float(data["stepsPerSecond"]),
                       compute_bound=float(data["computeBound"]), aggregation_bound=float(data["aggregationBound"]),
                       averaging_seconds=float(data["averagingSeconds"]), group_size=int(data["groupSize"]),
                       peers=peers, step=data.get("step") if isinstance(data.get("step"), dict) else None)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanRecordError):
                raise
            raise PlanRecordError(f"malformed plan payload: {e!r}") from None


def plan_key(swarm: str) -> str:
    return swarm + PLAN_SUFFIX


def load_signing_key(identity_path: str) -> rsa.RSAPrivateKey:
    """The RSA key inside a libp2p identity file (hivemind's format: a protobuf PrivateKey)."""
    from hivemind.proto import crypto_pb2

    with open(identity_path, "rb") as f:
        der = crypto_pb2.PrivateKey.FromString(f.read()).data
    key = serialization.load_der_private_key(der, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{identity_path}: not an RSA identity")
    return key


def peer_id_of(public_der: bytes) -> str:
    """The base58 libp2p peer ID of an RSA public key (DER SubjectPublicKeyInfo)."""
    import multihash
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def sign_plan(plan: SignedPlan, key: rsa.RSAPrivateKey) -> dict[str, bytes]:
    payload = json.dumps(plan.to_json(), sort_keys=True).encode()
    public = key.public_key().public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return {"payload": payload, "publicKey": public, "signature": key.sign(payload, _PADDING, _HASH)}


def verify_plan(record: Any, *, signer: str, swarm: str, now: Optional[float] = None) -> SignedPlan:
    """The plan in `record` if `signer` (a base58 peer ID) signed it for `swarm` and it has not
    expired at `now` (DHT time); PlanRecordError otherwise."""
    if not isinstance(record, dict) or not all(isinstance(record.get(k), bytes)
                                               for k in ("payload", "publicKey", "signature")):
        raise PlanRecordError("not a plan record (payload, publicKey and signature bytes expected)")
    if peer_id_of(record["publicKey"]) != signer:
        raise PlanRecordError("signed by another key than the swarm's balancer")
    try:
        public = serialization.load_der_public_key(record["publicKey"])
        if not isinstance(public, rsa.RSAPublicKey):
            raise PlanRecordError("signer key is not RSA")
        public.verify(record["signature"], record["payload"], _PADDING, _HASH)
    except (InvalidSignature, ValueError) as e:
        raise PlanRecordError(f"bad signature: {type(e).__name__}") from None
    try:
        data = json.loads(record["payload"])
    except ValueError:
        raise PlanRecordError("payload is not JSON") from None
    if not isinstance(data, dict):
        raise PlanRecordError("payload is not an object")
    plan = SignedPlan.from_json(data)
    if plan.swarm != swarm:
        raise PlanRecordError(f"plan for swarm {plan.swarm!r}, not {swarm!r}")
    if now is None:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
    if plan.expires <= now:
        raise PlanRecordError(f"plan expired {now - plan.expires:.0f}s ago")
    return plan


def read_plan(dht, *, swarm: str, signer: str) -> SignedPlan:
    """The swarm's current plan from the DHT, verified; PlanRecordError if none is valid."""
    found = dht.get(plan_key(swarm), latest=True)
    if found is None:
        raise PlanRecordError("no plan published")
    return verify_plan(found.value, signer=signer, swarm=swarm)


def publish_plan(dht, plan: SignedPlan, key: rsa.RSAPrivateKey) -> None:
    dht.store(plan_key(plan.swarm), sign_plan(plan, key), expiration_time=plan.expires, return_future=True)
