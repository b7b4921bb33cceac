"""The BlockServer resource (Petals): servers that each hold a contiguous span of a causal
language model's transformer blocks, and a scripted client that generates through them.

The CRD schema is generated from these models (`hivekeeper.spec.crd`)."""

from __future__ import annotations

import math
from typing import ClassVar, Literal, Optional

from pydantic import Field, StrictBool, model_validator

from hivekeeper.spec.base import CelRule, SpecModel
from hivekeeper.spec.common import BackboneSpec, Resources
from hivekeeper.spec.join import JOIN_DESCRIPTION, JoinSpec, check_join
from hivekeeper.spec.network import PeerNetwork, check_networks, node_port_rule, not_client_only_rule
from hivekeeper.spec.placement import Placement, check_placements
from hivekeeper.spec.storage import ModelVolumeSpec
from hivekeeper.spec.volunteers import VolunteersSpec, check_lab_roles, lab_roles_rule

WireCompression = Literal["none", "float16", "blockwise8bit"]


class TinyModelSpec(SpecModel):
    """A small model built from a config with seeded random weights: identical in every process."""

    architecture: Literal["llama", "gpt2"] = Field("llama", description="Llama- or GPT-2-style blocks")
    hidden_size: int = Field(64, ge=8, le=4096, description="model width")
    num_layers: int = Field(6, ge=1, le=128, description="transformer blocks")
    num_heads: int = Field(4, ge=1, le=64, description="attention heads per block")
    vocab_size: int = Field(256, ge=2, le=262144, description="256: bytes are tokens, no tokenizer needed")
    max_positions: int = Field(512, ge=8, le=65536, description="the longest sequence (prompt + generated)")
    seed: int = Field(0, ge=0, description="seed of the random weights")

    cel_rules = (CelRule("self.hiddenSize % self.numHeads == 0", "must be a multiple of numHeads", ".hiddenSize"),)

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelSpec":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hiddenSize ({self.hidden_size}) must be a multiple of numHeads ({self.num_heads})")
        return self


class ModelSpec(SpecModel):
    checkpoint: Optional[str] = Field(
        None, min_length=1, description="local Hugging Face folder (save_pretrained); never downloaded")
    tiny: Optional[TinyModelSpec] = Field(None, description="used when no checkpoint is given")
    volume: Optional[ModelVolumeSpec] = Field(
        None, description="cluster only: the volume the checkpoint folder is on, mounted read-only in every pod")

    cel_rules = (
        CelRule("!has(self.checkpoint) || !has(self.tiny)", "set either checkpoint or tiny, not both"),
        # volume.holds(checkpoint): the path is the mount path or under it
        CelRule("!has(self.volume) || (has(self.checkpoint) && (self.checkpoint + '/').startsWith("
                "self.volume.mountPath.endsWith('/') ? self.volume.mountPath : self.volume.mountPath + '/'))",
                "must be a folder under volume.mountPath: the pods read it from the volume", ".checkpoint"),
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if self.checkpoint is not None and self.tiny is not None:
            raise ValueError("set either checkpoint or tiny, not both")
        if self.volume is not None and (self.checkpoint is None or not self.volume.holds(self.checkpoint)):
            raise ValueError(f"checkpoint ({self.checkpoint!r}) must be a folder under volume.mountPath "
                             f"({self.volume.mount_path}): the pods read it from the volume")
        if self.checkpoint is None and self.tiny is None:
            self.tiny = TinyModelSpec()
        return self


class ServersSpec(SpecModel):
    replicas: int = Field(3, ge=0, description="block servers")
    span_length: Optional[int] = Field(
        None, ge=1, description="blocks each server holds; default: enough for the servers to cover the model")
    cache_tokens: int = Field(
        8192, ge=1, description="attention-cache token positions a server keeps for all sessions together")
    max_session_tokens: int = Field(2048, ge=1, description="the longest inference session (prompt + generated)")
    session_timeout_seconds: float = Field(120.0, gt=0, description="an idle session's cache is freed after this")
    weights: Literal["float32", "int8"] = Field("float32", description="int8: per-row 8-bit weights, dequantized per call")
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:\d+)?)$",
                        description="where a server keeps its span: cpu, cuda, cuda:N, or auto (cuda when there is one); "
                                    "on cuda, decoding runs a static KV cache replayed as a CUDA graph")
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(
        None, description="the span's dtype; default float32 on cpu, bfloat16 on cuda")
    balance_quality: float = Field(
        0.75, gt=0, description="move to another span only if the worst block's throughput rises so that old/new < this")
    rebalance_seconds: float = Field(30.0, gt=0, description="how often an online server checks whether to move")
    torch_threads: Optional[int] = Field(
        None, ge=1, description="CPU threads per server for torch; default: the cores the server is given "
                                "(its container's CPU limit, else resources.cpu rounded up)")
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="2Gi"),
                                 description="each server pod's")
    placement: Placement = Field(default_factory=Placement)
    network: PeerNetwork = Field(default_factory=PeerNetwork, description="how peers outside the cluster reach them")


class BalancerSpec(SpecModel):
    """Computes a global span assignment maximizing the worst block's throughput and publishes it."""

    enabled: StrictBool = Field(True, description="false: servers choose their spans by Petals' rule alone")
    replan_seconds: float = Field(10.0, gt=0, description="how often the assignment is solved again")
    placement: Placement = Field(default_factory=Placement)


class ClientSpec(SpecModel):
    """A scripted client: generates from a prompt through the servers, then the run is done."""

    enabled: StrictBool = Field(True, description="run the scripted client; false: servers only, the run never ends")
    prompt: str = Field("def fibonacci(n):", min_length=1, max_length=65536, description="text to continue")
    new_tokens: int = Field(32, ge=1, le=4096, description="tokens to generate")
    do_sample: StrictBool = Field(False, description="false: greedy decoding")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (doSample)")
    top_k: Optional[int] = Field(None, ge=1, description="sample among the k likeliest tokens (doSample); default: all")
    seed: int = Field(0, ge=0, description="sampling seed")
    verify_local: StrictBool = Field(
        True, description="also generate with the whole model in the client's process and compare tokens")
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="1Gi"),
                                 description="the client pod's")
    placement: Placement = Field(default_factory=Placement)


def _tiny(field: str) -> str:
    """CEL for a field of the tiny model: without a checkpoint or tiny the model is the default tiny one."""
    default = TinyModelSpec().model_dump(by_alias=True)[field]
    return f"(has(self.model.tiny) ? self.model.tiny.{field} : {default})"


# what a lab that joins this kind may run (spec.volunteers.labs)
LAB_ROLES = ("backbone", "server")
# what a joining BlockServer (spec.join) states itself: its servers, their hardware and place
LAB_OWNED = ("join", "placement", "backbone", "servers.replicas", "servers.resources", "servers.placement",
             "servers.device", "servers.torchThreads", "servers.network")
# groups whose peers others must be able to dial, and why
DIALED = {"backbone": "every peer bootstraps from the backbone", "servers": "clients call the servers"}


class BlockServerSpec(SpecModel):
    model: ModelSpec = Field(default_factory=ModelSpec, description="the causal language model whose blocks are served")
    servers: ServersSpec = Field(default_factory=ServersSpec, description="the block servers")
    compression: WireCompression = Field("none", description="hidden states on the wire")
    balancer: BalancerSpec = Field(default_factory=BalancerSpec)
    client: ClientSpec = Field(default_factory=ClientSpec)
    backbone: BackboneSpec = Field(default_factory=BackboneSpec, description="the DHT peers every other peer "
                                                                             "bootstraps from")
    volunteers: VolunteersSpec = Field(default_factory=VolunteersSpec,
                                       description="let machines outside the cluster join as servers, by token")
    placement: Placement = Field(default_factory=Placement, description="every pod's; merged under each group's")
    join: Optional[JoinSpec] = Field(None, description=JOIN_DESCRIPTION)

    lab_owned: ClassVar[tuple[str, ...]] = LAB_OWNED
    cel_rules = (
        lab_roles_rule(LAB_ROLES, "BlockServer"),
        *(node_port_rule(group) for group in DIALED),
        *(not_client_only_rule(group, why) for group, why in DIALED.items()),
        CelRule(f"has(self.model.checkpoint) || !self.client.enabled || "
                f"(self.client.newTokens + size(bytes(self.client.prompt)) <= {_tiny('maxPositions')} && "
                f"self.client.newTokens + size(bytes(self.client.prompt)) <= self.servers.maxSessionTokens)",
                "prompt (its bytes are tokens) + newTokens exceed the model's maxPositions or servers.maxSessionTokens",
                ".client.newTokens"),
        CelRule(f"!has(self.servers.spanLength) || has(self.model.checkpoint) || "
                f"self.servers.spanLength <= {_tiny('numLayers')}", "exceeds the model's numLayers",
                ".servers.spanLength"),
        CelRule("self.servers.maxSessionTokens <= self.servers.cacheTokens", "exceeds servers.cacheTokens",
                ".servers.maxSessionTokens"),
    )

    @model_validator(mode="after")
    def _consistent(self) -> "BlockServerSpec":
        tiny = self.model.tiny
        if tiny is not None:
            needed = self.client.new_tokens + len(self.client.prompt.encode())
            if self.client.enabled and needed > min(tiny.max_positions, self.servers.max_session_tokens):
                raise ValueError(
                    f"client: prompt ({len(self.client.prompt.encode())} tokens) + newTokens ({self.client.new_tokens})"
                    f" exceed the model's maxPositions or servers.maxSessionTokens")
            if self.servers.span_length is not None and self.servers.span_length > tiny.num_layers:
                raise ValueError(f"servers.spanLength ({self.servers.span_length}) exceeds the model's "
                                 f"{tiny.num_layers} blocks")
        if self.servers.max_session_tokens > self.servers.cache_tokens:
            raise ValueError(f"servers.maxSessionTokens ({self.servers.max_session_tokens}) exceeds "
                             f"servers.cacheTokens ({self.servers.cache_tokens})")
        check_lab_roles(self.volunteers, LAB_ROLES, "BlockServer")
        check_networks({"backbone": (self.backbone.network, self.backbone.replicas),
                        "servers": (self.servers.network, self.servers.replicas)}, DIALED, self.volunteers.node_ports())
        check_placements(self)
        check_join(self, LAB_OWNED, "BlockServer")
        return self


def span_length(spec: BlockServerSpec, num_blocks: int) -> int:
    """Blocks per server: the spec's, or the fewest with which the servers cover the model."""
    if spec.servers.span_length is not None:
        return min(spec.servers.span_length, num_blocks)
    return math.ceil(num_blocks / max(spec.servers.replicas, 1))
