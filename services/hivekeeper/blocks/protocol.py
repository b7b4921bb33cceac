"""What servers and clients agree on: the servers' DHT records, the balancer's plan record, and
requests on the wire (hivemind's ExpertRequest: `uid` names the blocks "start:end", tensors
are hidden states, possibly compressed, and `metadata` is a msgpack dict)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch

SERVERS_KEY = "_blockservers"  # subkey per server peer: its ServerInfo
PLAN_KEY = "_blockplan"  # the balancer's span assignment
RECORD_EXPIRATION = 20.0  # seconds a server's record lives without a refresh
PROTOCOL_VERSION = "hivekeeper-blocks/1"

JOINING, ONLINE, OFFLINE = "joining", "online", "offline"


@dataclass(frozen=True)
class ServerInfo:
    peer_id: str
    name: str
    state: str  # joining | online | offline
    start: int
    end: int  # exclusive
    throughput: float  # tokens/s per block: min(compute, network), what the balancer weighs
    inference_rps: float  # one-token inference steps/s through one block (routing's compute term)
    forward_rps: float  # tokens/s through one block in a batched forward
    network_rps: float  # hidden states/s the wire codec moves (loopback has no slower link)
    cache_tokens_left: int
    version: str = PROTOCOL_VERSION
    time: float = 0.0

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Any) -> Optional["ServerInfo"]:
        """None for anything that is not a well-formed record (a stale format, garbage)."""
        try:
            info = cls(**record)
        except TypeError:
            return None
        ok = (isinstance(info.start, int) and isinstance(info.end, int) and 0 <= info.start < info.end
              and info.state in (JOINING, ONLINE, OFFLINE) and info.version == PROTOCOL_VERSION)
        return info if ok else None


def announce(dht, run_id: str, info: ServerInfo) -> None:
    from hivemind.utils import get_dht_time

    record = {**info.to_record(), "time": time.time()}
    dht.store(run_id + SERVERS_KEY, subkey=info.peer_id, value=record,
              expiration_time=get_dht_time() + RECORD_EXPIRATION, return_future=True)


def read_servers(dht, run_id: str) -> list[ServerInfo]:
    found = dht.get(run_id + SERVERS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    servers = []
    for entry in found.value.values():
        info = ServerInfo.from_record(getattr(entry, "value", None))
        if info is not None:
            servers.append(info)
    return sorted(servers, key=lambda s: s.peer_id)


def publish_plan(dht, run_id: str, assignments: dict[str, tuple[int, int]], min_throughput: float,
                 ttl: float) -> None:
    from hivemind.utils import get_dht_time

    value = {"assignments": {peer: list(span) for peer, span in assignments.items()},
             "minThroughput": min_throughput, "time": time.time()}
    dht.store(run_id + PLAN_KEY, value, expiration_time=get_dht_time() + ttl)


def read_plan(dht, run_id: str) -> Optional[dict[str, Any]]:
    found = dht.get(run_id + PLAN_KEY, latest=True)
    if found is None or not isinstance(found.value, dict) or not isinstance(found.value.get("assignments"), dict):
        return None
    return found.value


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


def make_request(start: int, end: int, tensors: Sequence[torch.Tensor], metadata: dict[str, Any],
                 compression: str = "none"):
    from hivemind.proto import runtime_pb2
    from hivemind.utils import MSGPackSerializer

    protos, codec = encode_tensors(tensors, compression)
    return runtime_pb2.ExpertRequest(uid=f"{start}:{end}", tensors=protos,
                                     metadata=MSGPackSerializer.dumps({**metadata, **codec}))


def make_response(tensors: Sequence[torch.Tensor], metadata: dict[str, Any], compression: str = "none"):
    from hivemind.proto import runtime_pb2
    from hivemind.utils import MSGPackSerializer

    protos, codec = encode_tensors(tensors, compression)
    return runtime_pb2.ExpertResponse(tensors=protos, metadata=MSGPackSerializer.dumps({**metadata, **codec}))


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
