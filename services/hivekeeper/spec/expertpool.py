"""The ExpertPool resource (Learning@home decentralized mixture-of-experts): expert servers
that together hold the experts of a d-dimensional grid, and trainers whose DMoE layers pick
top-k experts from the grid by beam search over the DHT.

The CRD schema is generated from these models (`hivekeeper.spec.crd`); the status model lives
there too (it imports the manifest module, which imports this one)."""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal, Optional

from pydantic import Field, StrictBool, model_validator

from hivekeeper.spec.base import CelRule, SpecModel
from hivekeeper.spec.common import BackboneSpec, Resources
from hivekeeper.spec.join import JOIN_DESCRIPTION, JoinSpec, check_join
from hivekeeper.spec.network import PeerNetwork, check_networks, node_port_rule, not_client_only_rule
from hivekeeper.spec.placement import DNS_SUBDOMAIN, Placement, check_placements
from hivekeeper.spec.storage import VolumeClaimSpec, check_claim, claim_rules
from hivekeeper.spec.training import OptimizerSpec, StoppingSpec, TaskSpec
from hivekeeper.spec.volunteers import VolunteersSpec, check_lab_roles, lab_roles_rule

DIGITS_PIXELS = 64  # the digits task's 8x8 images: what a transformer trainer splits into tokens
MAX_GRID_DIMENSIONS = 4


class GridSpec(SpecModel):
    """Expert uids are PREFIX.u0.u1...u(d-1) with ui in [0, dimensions[i]) (Learning@home 3.2)."""

    uid_prefix: str = Field("expert", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$", max_length=40,
                            description="first part of every expert uid (no dots)")
    dimensions: list[Annotated[int, Field(ge=1, le=256)]] = Field(
        default_factory=lambda: [4, 4], min_length=1, max_length=MAX_GRID_DIMENSIONS,
        description="M for each of the d grid dimensions")

    @property
    def size(self) -> int:
        return math.prod(self.dimensions)


class ExpertSpec(SpecModel):
    type: Literal["feedforward", "transformer"] = Field(
        "feedforward", description="feedforward: vectors in, vectors out; transformer: an encoder block over tokens")
    hidden_size: int = Field(64, ge=4, le=8192, description="input and output width of every expert")
    ffn_multiplier: int = Field(4, ge=1, le=16, description="inner width = hiddenSize x this")
    num_heads: int = Field(4, ge=1, le=128, description="attention heads (transformer)")
    sequence_length: int = Field(8, ge=1, le=8192, description="tokens per example (transformer)")

    cel_rules = (CelRule("self.type != 'transformer' || self.hiddenSize % self.numHeads == 0",
                         "must be divisible by numHeads (transformer)", ".hiddenSize"),)

    @model_validator(mode="after")
    def _heads_divide(self) -> "ExpertSpec":
        if self.type == "transformer" and self.hidden_size % self.num_heads:
            raise ValueError(f"hiddenSize ({self.hidden_size}) must be divisible by numHeads ({self.num_heads})")
        return self


class ServerSpec(SpecModel):
    replicas: int = Field(2, ge=1, description="expert servers; the grid is spread over them")
    experts_per_server: Optional[int] = Field(
        None, ge=1, description="experts each server holds; default: the grid divided evenly over the servers")
    max_batch_size: int = Field(1024, ge=1, description="examples a server batches into one expert call")
    announce_period_seconds: float = Field(2.0, gt=0, description="how often servers re-announce their experts")
    announce_expiration_seconds: float = Field(
        6.0, gt=0, description="DHT entries of a server's experts expire this long after its last announcement")
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="2Gi"),
                                 description="each server pod's")
    placement: Placement = Field(default_factory=Placement)
    network: PeerNetwork = Field(default_factory=PeerNetwork, description="how peers outside the cluster reach them")


class CheckpointClaimSpec(VolumeClaimSpec):
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        "ReadWriteMany", description="ReadWriteOnce suits only a cluster where every server runs on one node")


class CheckpointSpec(SpecModel):
    """Servers keep one file per expert in one directory they all share, so that whichever server
    holds an expert after a restart or a rebalance finds its file: in a cluster, one claim shared
    by every server (not a volume per server)."""

    enabled: StrictBool = Field(True, description="save every expert, and resume from the saved files")
    dir: Optional[str] = Field(None, description="shared by all servers; default: RUN_DIR/experts "
                                                 "(in a cluster: where the servers' claim is mounted)")
    every_seconds: float = Field(5.0, gt=0, description="servers save their experts this often (and at shutdown)")
    volume_claim: Optional[CheckpointClaimSpec] = Field(
        None, description="cluster only: keep the checkpoints on a claim the operator makes and deletes with the "
                          "pool, so a rescheduled or rebalanced server resumes its experts (without a claim they "
                          "live in each pod's emptyDir); locally the servers share the run directory already")
    existing_claim: Optional[str] = Field(
        None, pattern=DNS_SUBDOMAIN, max_length=253,
        description="cluster only: a PersistentVolumeClaim of yours instead (ReadWriteMany unless every server runs "
                    "on one node); the operator never deletes it")

    def directory(self, run_dir: str) -> str:
        return self.dir or f"{run_dir}/experts"

    cel_rules = claim_rules("dir")

    @model_validator(mode="after")
    def _one_claim(self) -> "CheckpointSpec":
        check_claim(self.volume_claim, self.existing_claim, self.dir, "dir", self.enabled)
        return self


class DMoESpec(SpecModel):
    """The trainer's decentralized mixture-of-experts layers (Learning@home 3.1, 3.2)."""

    layers: int = Field(2, ge=1, le=16, description="DMoE layers in the trainer's model")
    k_best: int = Field(4, ge=1, description="experts each example is sent to (top-k by beam search)")
    k_min: int = Field(1, ge=1, description="an example needs this many responding experts, or its batch fails")
    forward_timeout_seconds: float = Field(10.0, gt=0, description="give up on an expert's forward reply after this")
    timeout_after_k_min_seconds: float = Field(
        1.0, gt=0, description="once every example has kMin replies, wait this much longer for the rest")
    backward_timeout_seconds: float = Field(10.0, gt=0, description="give up on an expert's backward reply after this")


class ExpertTrainerSpec(SpecModel):
    replicas: Optional[int] = Field(
        None, ge=0, description="trainers; each has its own gating and local layers, the experts are shared. "
                                "Default: 1 in a pool that hosts, none in one that joins another (spec.join), "
                                "which may run trainers only if it asks for them")
    batch_size: int = Field(32, ge=1, description="examples per trainer batch")
    batches_in_flight: int = Field(4, ge=1, le=256, description="asynchronous training: batches processed concurrently")
    optimizer: OptimizerSpec = Field(default_factory=lambda: OptimizerSpec(learning_rate=3e-3),
                                     description="for the trainer's own parameters (gating, input and output layers)")
    dmoe: DMoESpec = Field(default_factory=DMoESpec)
    eval_every_steps: int = Field(20, ge=1, description="evaluate held-out metrics every N batches")
    resources: Resources = Field(default_factory=Resources, description="each trainer pod's")
    placement: Placement = Field(default_factory=Placement)


def _grid_size() -> str:
    """CEL for the grid's size, the product of its 1 to MAX_GRID_DIMENSIONS dimensions."""
    dims = "self.grid.dimensions"
    return " * ".join([f"{dims}[0]", *(f"(size({dims}) > {i} ? {dims}[{i}] : 1)" for i in range(1, MAX_GRID_DIMENSIONS))])


# what a lab that joins this kind may run (spec.volunteers.labs)
LAB_ROLES = ("backbone", "server", "trainer")
# what a joining ExpertPool (spec.join) states itself: its servers and trainers, their hardware and place
LAB_OWNED = ("join", "placement", "backbone", "servers.replicas", "servers.resources", "servers.placement",
             "servers.network", "trainers.replicas", "trainers.resources", "trainers.placement")
# groups whose peers others must be able to dial, and why
DIALED = {"backbone": "every peer bootstraps from the backbone", "servers": "clients call the servers"}


class ExpertPoolSpec(SpecModel):
    task: TaskSpec = Field(default_factory=TaskSpec, description="the data trainers learn from (digits)")
    grid: GridSpec = Field(default_factory=GridSpec)
    expert: ExpertSpec = Field(default_factory=ExpertSpec, description="every expert's shape")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec,
                                     description="how servers update expert weights on each backward request")
    backbone: BackboneSpec = Field(default_factory=BackboneSpec, description="the DHT peers every other peer "
                                                                             "bootstraps from")
    servers: ServerSpec = Field(default_factory=ServerSpec, description="the expert servers")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    trainers: ExpertTrainerSpec = Field(default_factory=ExpertTrainerSpec,
                                        description="the trainers whose DMoE layers call the experts")
    stopping: StoppingSpec = Field(default_factory=lambda: StoppingSpec(target_steps=200),
                                   description="when the run is done")
    volunteers: VolunteersSpec = Field(default_factory=VolunteersSpec,
                                       description="let machines outside the cluster join as expert servers, by token")
    placement: Placement = Field(default_factory=Placement, description="every pod's; merged under each group's")
    join: Optional[JoinSpec] = Field(None, description=JOIN_DESCRIPTION)

    lab_owned: ClassVar[tuple[str, ...]] = LAB_OWNED

    @property
    def hosted_experts(self) -> int:
        """Experts the servers hold: the grid may leave room for more (Learning@home 3.2)."""
        per_server = self.servers.experts_per_server or math.ceil(self.grid.size / self.servers.replicas)
        return min(self.grid.size, per_server * self.servers.replicas)

    cel_rules = (
        lab_roles_rule(LAB_ROLES, "ExpertPool"),
        *(node_port_rule(group) for group in DIALED),
        *(not_client_only_rule(group, why) for group, why in DIALED.items()),
        CelRule("has(self.join) || !has(self.trainers.replicas) || self.trainers.replicas >= 1",
                "a pool needs a trainer (only one that joins another may have none)", ".trainers.replicas"),
        CelRule("self.task.name == 'digits'", "ExpertPool trainers learn the digits task", ".task.name"),
        # the task's options: the operator checks them (InvalidSpec)
        CelRule("self.trainers.dmoe.kMin <= self.trainers.dmoe.kBest", "exceeds trainers.dmoe.kBest",
                ".trainers.dmoe.kMin"),
        CelRule(f"self.trainers.dmoe.kBest <= {_grid_size()} && (!has(self.servers.expertsPerServer) || "
                f"self.trainers.dmoe.kBest <= self.servers.expertsPerServer * self.servers.replicas)",
                "exceeds the experts the servers hold (the grid's, at most servers.expertsPerServer x replicas)",
                ".trainers.dmoe.kBest"),
        CelRule(f"self.expert.type != 'transformer' || {DIGITS_PIXELS} % self.expert.sequenceLength == 0",
                f"must divide the digits' {DIGITS_PIXELS} pixels (1, 2, 4, 8, 16, 32 or 64)", ".expert.sequenceLength"),
        CelRule("self.servers.announceExpirationSeconds > self.servers.announcePeriodSeconds",
                "must exceed announcePeriodSeconds, or experts vanish from the DHT between announcements",
                ".servers.announceExpirationSeconds"),
    )

    @model_validator(mode="after")
    def _consistent(self) -> "ExpertPoolSpec":
        if self.trainers.replicas is None:  # left out: the default depends on whether the pool joins
            self.trainers.replicas = 0 if self.join is not None else 1
        if self.task.name != "digits":
            raise ValueError(f"task.name: ExpertPool trainers learn the digits task (got {self.task.name!r})")
        from hivekeeper.tasks import check_task_options  # imports torch: only once the rest is valid

        error = check_task_options(self.task.name, self.task.options)
        if error:
            raise ValueError(f"task.{error}")
        dmoe = self.trainers.dmoe
        if dmoe.k_min > dmoe.k_best:
            raise ValueError(f"trainers.dmoe.kMin ({dmoe.k_min}) exceeds kBest ({dmoe.k_best})")
        if dmoe.k_best > self.hosted_experts:
            raise ValueError(f"trainers.dmoe.kBest ({dmoe.k_best}) exceeds the experts the servers hold "
                             f"({self.hosted_experts})")
        if self.expert.type == "transformer" and DIGITS_PIXELS % self.expert.sequence_length:
            raise ValueError(f"expert.sequenceLength ({self.expert.sequence_length}) must divide the digits' "
                             f"{DIGITS_PIXELS} pixels (1, 2, 4, 8, 16, 32 or 64)")
        if self.servers.announce_expiration_seconds <= self.servers.announce_period_seconds:
            raise ValueError("servers.announceExpirationSeconds must exceed announcePeriodSeconds, "
                             "or experts vanish from the DHT between announcements")
        if self.trainers.replicas == 0 and self.join is None:
            raise ValueError("trainers.replicas: a pool needs a trainer (only one that joins another may have none)")
        check_lab_roles(self.volunteers, LAB_ROLES, "ExpertPool")
        check_networks({"backbone": (self.backbone.network, self.backbone.replicas),
                        "servers": (self.servers.network, self.servers.replicas)}, DIALED, self.volunteers.node_ports())
        check_placements(self)
        check_join(self, LAB_OWNED, "ExpertPool")
        return self
