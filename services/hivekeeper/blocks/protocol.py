"""What servers and clients agree on: the servers' DHT records, the balancer's plan record, and
requests on the wire (hivemind's ExpertRequest: `uid` names the blocks "start:end", tensors
are hidden states, possibly compressed, and `metadata` is a msgpack dict)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum
from typing import Any, Optional, Sequence, get_type_hints

import torch

log = logging.getLogger("hivekeeper.blocks.protocol")
SERVERS_KEY = "_blockservers"  # subkey per server peer: its ServerInfo
PLAN_KEY = "_blockplan"  # the balancer's span assignment
RECORD_EXPIRATION = 20.0  # seconds a server's record lives without a refresh
# "NAME/MAJOR[.MINOR]": a minor version only adds fields (older peers ignore them); a new major
# changes what existing fields mean, and peers of another major ignore each other's records.
# 1.1 adds `direct`.
PROTOCOL_NAME, PROTOCOL_MAJOR, PROTOCOL_MINOR = "hivekeeper-blocks", 1, 1
PROTOCOL_VERSION = f"{PROTOCOL_NAME}/{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"


class ServerState(str, Enum):
    """On the wire as its value: the strings every version of the protocol sends."""

    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"

    def __str__(self) -> str:
        return self.value


JOINING, ONLINE, OFFLINE = ServerState


class ErrorCode(str, Enum):
    """Why a server did not answer a request (the `error` of a reply's metadata)."""

    REFUSED = "refused"  # the request cannot be served here: malformed, wrong blocks, no cache left
    FAILED = "error"  # the server failed computing it


class RecordError(ValueError):
    """A DHT record that does not parse; the message names the field."""


@dataclass(frozen=True)
class ServerInfo:
    peer_id: str
    name: str
    state: ServerState
    start: int
    end: int  # exclusive
    throughput: float  # tokens/s per block: min(compute, network), what the balancer weighs
    inference_rps: float  # one-token inference steps/s through one block (routing's compute term)
    forward_rps: float  # tokens/s through one block in a batched forward
    network_rps: float  # hidden states/s the wire codec moves (loopback has no slower link)
    cache_tokens_left: int
    version: str = PROTOCOL_VERSION
    time: float = 0.0
    # "host:port" where the server also answers block calls on a TCP port of its own (direct.py), for
    # clients that can reach it; "" (and in records of 1.0 servers): through p2pd only
    direct: str = ""

    def to_record(self) -> dict[str, Any]:
        return {**asdict(self), "state": ServerState(self.state).value}

    @classmethod
    def from_record(cls, record: Any) -> Optional["ServerInfo"]:
        """The record's ServerInfo, ignoring fields this version does not know; None (logged once
        at debug) for a record of another major version, or missing a field, or of wrong types."""
        try:
            if not isinstance(record, dict):
                raise RecordError(f"expected a mapping, got {type(record).__name__}")
            info = cls(**{f.name: _field(record, f.name, _TYPES[f.name]) for f in fields(cls)
                          if f.name in record or f.default is MISSING})
            if not compatible(info.version):
                raise RecordError(f"version {info.version!r} is not {PROTOCOL_NAME}/{PROTOCOL_MAJOR}[.minor]")
            if not 0 <= info.start < info.end:
                raise RecordError(f"span {info.start}:{info.end} is empty or negative")
        except RecordError as e:
            _reject(record, str(e))
            return None
        return info


def _field(record: dict, name: str, kind: type) -> Any:
    """record[name] as `kind` (float also takes an int: a writer may send 7 for 7.0)."""
    if name not in record:
        raise RecordError(f"missing field {name!r}")
    value = record[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float and number and math.isfinite(value):
        return float(value)
    if (kind is int and number and isinstance(value, int)) or (kind is str and isinstance(value, str)):
        return value
    if issubclass(kind, Enum) and isinstance(value, str) and value in {m.value for m in kind}:
        return kind(value)
    raise RecordError(f"field {name!r}: {value!r:.60} is not a valid {kind.__name__}")


_TYPES = get_type_hints(ServerInfo)
_rejected: set[tuple[str, str]] = set()


def _reject(record: Any, reason: str) -> None:
    """Log a bad record at debug, once per peer and reason (records are read every few seconds)."""
    peer = str(record.get("peer_id"))[:60] if isinstance(record, dict) else "?"
    if (peer, reason) not in _rejected and len(_rejected) < 1000:
        _rejected.add((peer, reason))
        log.debug("ignoring a server record", extra={"fields": {"peer_id": peer, "reason": reason}})


def compatible(version: str) -> bool:
    """Same protocol and major version (any minor)."""
    name, _, number = version.partition("/")
    return name == PROTOCOL_NAME and number.split(".", 1)[0] == str(PROTOCOL_MAJOR)


def announce(dht, run_id: str, info: ServerInfo) -> None:
    from hivemind.utils import get_dht_time

    record = {**info.to_record(), "time": time.time()}
    dht.store(run_id + SERVERS_KEY, subkey=info.peer_id, value=record,
              expiration_time=get_dht_time() + RECORD_EXPIRATION, return_future=True)


def read_servers(dht, run_id: str) -> list[ServerInfo]:
    found = dht.get(run_id + SERVERS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    servers = (ServerInfo.from_record(getattr(entry, "value", None)) for entry in found.value.values())
    return sorted((info for info in servers if info is not None), key=lambda s: s.peer_id)


def publish_plan(dht, run_id: str, assignments: dict[str, tuple[int, int]], min_throughput: float,
                 ttl: float) -> None:
    from hivemind.utils import get_dht_time

    value = {"assignments": {peer: list(span) for peer, span in assignments.items()},
             "minThroughput": min_throughput, "time": time.time()}
    dht.store(run_id + PLAN_KEY, value, expiration_time=get_dht_time() + ttl)


def read_plan(dht, run_id: str) -> Optional[dict[str, Any]]:
    found = dht.get(run_id + PLAN_KEY, latest=True)
    plan = found.value if found is not None else None
    if not isinstance(plan, dict) or not isinstance(plan.get("assignments"), dict) \
            or not isinstance(plan.get("time", 0), (int, float)):
        return None
    return plan


# --- the wire ---------------------------------------------------------------------------

BLOCKWISE_BLOCK = 64  # values per absmax scale in blockwise 8-bit


def encode_tensors(tensors: Sequence[torch.Tensor], compression: str) -> tuple[list, dict[str, Any]]:
    """Hidden states as protobuf tensors. "float16" is hivemind's codec. "blockwise8bit" is ours:
    int8 codes with one float16 absmax scale per 64 values (8.25 bits a value). hivemind's own
    blockwise codec needs bitsandbytes, whose CPU library does not load on every machine."""
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    if compression != "blockwise8bit":
        kind = {"none": runtime_pb2.CompressionType.NONE, "float16": runtime_pb2.CompressionType.FLOAT16}[compression]
        return [serialize_torch_tensor(t.detach(), kind) for t in tensors], {}
    out, shapes = [], []
    for t in tensors:
        flat = t.detach().float().flatten()
        blocks = torch.nn.functional.pad(flat, (0, (-flat.numel()) % BLOCKWISE_BLOCK)).view(-1, BLOCKWISE_BLOCK)
        scale = (blocks.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12).half()
        codes = torch.round(blocks / scale.float()).clamp(-127, 127).to(torch.int8)
        out += [serialize_torch_tensor(codes), serialize_torch_tensor(scale)]
        shapes.append(list(t.shape))
    return out, {"codec": "blockwise8bit", "shapes": shapes}


def decode_tensors(protos: Sequence, metadata: dict[str, Any]) -> list[torch.Tensor]:
    from hivemind.compression import deserialize_torch_tensor

    tensors = [deserialize_torch_tensor(t) for t in protos]
    if metadata.get("codec") != "blockwise8bit":
        return [t.float() for t in tensors]
    shapes = metadata.get("shapes")
    if not isinstance(shapes, list) or len(tensors) != 2 * len(shapes):
        raise ValueError("blockwise8bit: expected codes and scales for every shape")
    out = []
    for (codes, scale), shape in zip(zip(tensors[::2], tensors[1::2]), shapes):
        size = int(torch.Size(shape).numel())
        if codes.dtype != torch.int8 or codes.dim() != 2 or scale.shape != (codes.shape[0], 1) \
                or codes.numel() < size:
            raise ValueError("blockwise8bit: codes and scales do not match")
        out.append((codes.float() * scale.float()).flatten()[:size].view(shape))
    return out


def _message(message_type: str, tensors: Sequence[torch.Tensor], metadata: dict[str, Any], compression: str,
             **fields: Any):
    from hivemind.proto import runtime_pb2
    from hivemind.utils import MSGPackSerializer

    protos, codec = encode_tensors(tensors, compression)
    return getattr(runtime_pb2, message_type)(tensors=protos, metadata=MSGPackSerializer.dumps({**metadata, **codec}),
                                              **fields)


def make_request(start: int, end: int, tensors: Sequence[torch.Tensor], metadata: dict[str, Any],
                 compression: str = "none"):
    return _message("ExpertRequest", tensors, metadata, compression, uid=f"{start}:{end}")


def make_response(tensors: Sequence[torch.Tensor], metadata: dict[str, Any], compression: str = "none"):
    return _message("ExpertResponse", tensors, metadata, compression)


def make_error(code: ErrorCode, message: str):
    """A refusal: no tensors, and metadata {"error": {"code": ..., "message": one line}}."""
    return make_response([], {"error": {"code": code.value, "message": message}})


def read_error(message) -> Optional[tuple[str, str]]:
    """(code, one-line message) of a refusal; None for an answer. ValueError for a malformed
    reason. Codes this version does not know are passed on as they are."""
    error = read_metadata(message).get("error")
    if error is None:
        return None
    if not isinstance(error, dict) or not isinstance(error.get("code"), str) \
            or not isinstance(error.get("message"), str):
        raise ValueError(f"malformed error reason {error!r:.100}: expected {{'code': str, 'message': str}}")
    return error["code"][:40], " ".join(error["message"].split())[:300] or "(no reason given)"


def read_tensors(message) -> list[torch.Tensor]:
    return decode_tensors(message.tensors, read_metadata(message))


def read_metadata(message) -> dict[str, Any]:
    from hivemind.utils import MSGPackSerializer

    if not message.metadata:
        return {}
    value = MSGPackSerializer.loads(message.metadata)
    if not isinstance(value, dict):
        raise ValueError("metadata must be a mapping")
    return value


def parse_span(uid: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in uid.split(":"))
    except ValueError:
        raise ValueError(f"blocks {uid!r}: expected 'start:end'") from None
    return start, end
