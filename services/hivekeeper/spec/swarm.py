"""The Swarm resource (DeDLOC collaborative training): one typed source of truth.

The CRD schema in crds/ is generated from these models (`hivekeeper.spec.crd`), so a field
added here is a field the cluster accepts."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, StrictBool, model_validator

from hivekeeper.spec.base import CelRule, SpecModel
from hivekeeper.spec.common import BackboneSpec, Resources
from hivekeeper.spec.join import JOIN_DESCRIPTION, JoinSpec, check_join
from hivekeeper.spec.network import PUBLIC, PeerNetwork, check_networks, node_port_rule, not_client_only_rule
from hivekeeper.spec.placement import DNS_SUBDOMAIN, Placement, check_placements
from hivekeeper.spec.storage import VolumeClaimSpec, check_claim, claim_rules
from hivekeeper.spec.training import OptimizerSpec, StoppingSpec, TaskSpec
from hivekeeper.spec.volunteers import VolunteersSpec, check_lab_roles, lab_roles_rule

CompressionName = Literal["none", "float16", "uniform8bit", "blockwise8bit"]
# A robust aggregator cannot tell which of two members is the hostile one: with one honest and
# one hostile sender CenteredClip starts from their mean and clips neither (they are equally far
# from it), so the attack goes through. Robust rounds (and merges) need three members; with fewer
# at hand a round fails and each peer steps on its own gradients, which no one else can move.
ROBUST_MIN_GROUP_SIZE = 3
MERGE_EVERY_STEPS = 10  # replicas merge this often unless mergeEverySteps or mergeEveryEpochs says otherwise
DILOCO_INNER_STEPS = 20  # DiLoCo's H unless innerSteps says otherwise
MERGE_ONLY_FIELDS = ("merge_every_steps", "merge_every_epochs", "merge_optimizer_state", "shift_every_steps")
DILOCO_ONLY_FIELDS = ("inner_steps", "outer_optimizer", "overlap_outer_round")


class BandwidthLimits(SpecModel):
    """Caps on what the balancer assumes a peer can move, whatever it measures (a metered link,
    a share of a NIC the peer must leave to others)."""

    upload_mbps: Optional[float] = Field(None, gt=0, description="upload cap per peer, megabits/s")
    download_mbps: Optional[float] = Field(None, gt=0, description="download cap per peer, megabits/s")


class TrainerSpec(SpecModel):
    replicas: int = Field(2, ge=0, description="trainers: peers that compute gradients (GPU or CPU)")
    batch_size: int = Field(32, ge=1, description="local batch per forward/backward pass")
    resources: Resources = Field(default_factory=Resources, description="each trainer pod's")
    client_mode: StrictBool = Field(False, description="trainers cannot accept inbound connections")
    bandwidth: BandwidthLimits = Field(default_factory=BandwidthLimits)
    placement: Placement = Field(default_factory=Placement)
    network: PeerNetwork = Field(default_factory=PeerNetwork, description="how peers outside the cluster reach them")


class AuxiliarySpec(SpecModel):
    replicas: int = Field(0, ge=0, description="CPU-only peers that only help averaging")
    resources: Resources = Field(default_factory=lambda: Resources(cpu="1", memory="1Gi"),
                                 description="each auxiliary pod's")
    bandwidth: BandwidthLimits = Field(default_factory=BandwidthLimits)
    placement: Placement = Field(default_factory=Placement)
    network: PeerNetwork = Field(default_factory=PeerNetwork, description="how peers outside the cluster reach them")


class BalancerSpec(SpecModel):
    """The averaging planner (DeDLOC appendix B): measures every peer, solves for roles and
    shares, and publishes a signed plan that peers follow from their next round."""

    enabled: Optional[StrictBool] = Field(
        None, description="default: on for gradient averaging, off when replicas merge weights (which it cannot plan)")
    replan_seconds: float = Field(10.0, gt=0, description="how often inputs are read and checked for drift")
    drift: float = Field(0.25, gt=0, description="relative change of any input that triggers a new plan")
    plan_ttl_seconds: float = Field(60.0, gt=0, description="peers drop a plan not renewed within this time")
    prometheus_url: Optional[str] = Field(
        None, pattern=r"^https?://", description="read inputs from this Prometheus; default: scrape peers directly")
    placement: Placement = Field(default_factory=Placement)


class CenteredClipSpec(SpecModel):
    """CenteredClip (Karimireddy et al. 2021, as BTARD decentralizes it): no sender pulls a part further than the radius."""

    radius: Optional[float] = Field(
        None, gt=0, description="clipping radius per element (RMS); default: the senders' median distance from "
                                "their coordinate-wise median, which follows the gradients' spread")
    iterations: int = Field(3, ge=1, le=50, description="clipping iterations per part")


class OuterOptimizerSpec(SpecModel):
    """DiLoCo's outer optimizer: SGD with Nesterov momentum on the averaged pseudo-gradient."""

    learning_rate: float = Field(0.7, gt=0, le=10, description="outer learning rate (DiLoCo: 0.7)")
    momentum: float = Field(0.9, ge=0, lt=1, description="outer momentum (DiLoCo: 0.9)")
    nesterov: StrictBool = Field(True, description="Nesterov momentum (DiLoCo's choice); false: heavy ball")


_OUTER_DEFAULTS = tuple((info.alias or name, str(info.default).lower())
                        for name, info in OuterOptimizerSpec.model_fields.items())


class AveragingSpec(SpecModel):
    matchmaking_seconds: float = Field(2.0, gt=0, description="time to gather a group before each round")
    timeout_seconds: float = Field(30.0, gt=0, description="give up on a round after this long")
    compression: CompressionName = Field("none", description="how tensors travel in averaging rounds")
    aggregation: Literal["mean", "centeredClip"] = Field(
        "mean", description="mean: hivemind's weighted mean; centeredClip: robust to hostile peers (docs/security.md)")
    centered_clip: CenteredClipSpec = Field(default_factory=CenteredClipSpec)
    delayed_parameter_updates: StrictBool = Field(False, description="DeDLOC's DPU: step in the background while computing")
    target_group_size: Optional[int] = Field(
        None, ge=2, description="all-reduce group size; default: the size that averages fastest given "
                                "peerFailureProbability (DeDLOC appendix C; every peer when it is 0)")
    peer_failure_probability: float = Field(
        0.0, ge=0, lt=1, description="chance that a peer fails a round, for the default group size")
    average_state_every: int = Field(1, ge=1, description="also average parameters every N steps")
    mode: Literal["gradients", "parameters", "ties", "diloco"] = Field(
        "gradients", description="gradients: DeDLOC's synchronous large-batch steps; parameters: replicas train "
                                 "alone and average weights (and optimizer state) every mergeEvery steps; "
                                 "ties: the same with a TIES merge; diloco: replicas take innerSteps local "
                                 "steps, then one outer step on the averaged pseudo-gradient (DiLoCo)")
    inner_steps: Optional[int] = Field(
        None, ge=1, description=f"diloco: local (inner) optimizer steps between outer steps, DiLoCo's H "
                                f"(default {DILOCO_INNER_STEPS})")
    outer_optimizer: OuterOptimizerSpec = Field(default_factory=OuterOptimizerSpec,
                                                description="diloco: the outer optimizer")
    overlap_outer_round: StrictBool = Field(
        False, description="diloco: run the outer all-reduce in the background while the next inner steps go on, "
                           "and apply it when it ends (one round late, as Streaming DiLoCo overlaps)")
    merge_every_steps: Optional[int] = Field(
        None, ge=1, description=f"merge after this many local optimizer steps (parameters, ties; default "
                                f"{MERGE_EVERY_STEPS})")
    merge_every_epochs: Optional[float] = Field(
        None, gt=0, description="or after this fraction of a pass over the training data")
    trim: Optional[float] = Field(
        None, gt=0, le=1, description="ties: keep this fraction of each offset's largest magnitudes (default: no trim)")
    merge_optimizer_state: StrictBool = Field(True, description="merge optimizer moments along with the weights")
    shift_every_steps: Optional[int] = Field(
        None, ge=1, description="model shifting: between merges, replicas move one place around a ring every N steps")

    @property
    def merges_weights(self) -> bool:
        """Replicas train alone and combine weights (or pseudo-gradients) now and then."""
        return self.mode != "gradients"

    @property
    def shares_optimizer_state(self) -> bool:
        """Optimizer moments travel with the weights (merging modes; DiLoCo keeps inner state local)."""
        return self.mode in ("parameters", "ties") and self.merge_optimizer_state

    cel_rules = (
        *(CelRule(f"self.mode == 'parameters' || self.mode == 'ties' || !has(self.{name})",
                  "only for mode parameters or ties", f".{name}")
          for name in ("mergeEverySteps", "mergeEveryEpochs", "shiftEverySteps")),
        CelRule("self.mode == 'parameters' || self.mode == 'ties' || self.mergeOptimizerState",
                "only for mode parameters or ties", ".mergeOptimizerState"),
        CelRule("self.mode == 'diloco' || !has(self.innerSteps)", "only for mode diloco", ".innerSteps"),
        CelRule("self.mode == 'diloco' || !self.overlapOuterRound", "only for mode diloco", ".overlapOuterRound"),
        CelRule("self.mode == 'diloco' || !has(self.outerOptimizer) || ("
                + " && ".join(f"(!has(self.outerOptimizer.{alias}) || self.outerOptimizer.{alias} == {value})"
                              for alias, value in _OUTER_DEFAULTS) + ")",
                "only for mode diloco", ".outerOptimizer"),
        CelRule("self.mode != 'diloco' || self.compression != 'blockwise8bit'",
                "diloco: none, float16 or uniform8bit", ".compression"),
        CelRule("!has(self.trim) || self.mode == 'ties'", "only for mode ties", ".trim"),
        CelRule("self.aggregation == 'centeredClip' || !has(self.centeredClip) || "
                "(!has(self.centeredClip.radius) && (!has(self.centeredClip.iterations) || "
                f"self.centeredClip.iterations == {CenteredClipSpec.model_fields['iterations'].default}))",
                "only for aggregation centeredClip", ".centeredClip"),
        CelRule(f"self.aggregation != 'centeredClip' || !has(self.targetGroupSize) || "
                f"self.targetGroupSize >= {ROBUST_MIN_GROUP_SIZE}",
                f"centeredClip needs groups of at least {ROBUST_MIN_GROUP_SIZE} (of two, neither can be told hostile)",
                ".targetGroupSize"),
        CelRule("!has(self.mergeEverySteps) || !has(self.mergeEveryEpochs)",
                "set mergeEverySteps or mergeEveryEpochs, not both", ".mergeEveryEpochs"),
        CelRule(f"!has(self.shiftEverySteps) || has(self.mergeEveryEpochs) || self.shiftEverySteps < "
                f"(has(self.mergeEverySteps) ? self.mergeEverySteps : {MERGE_EVERY_STEPS})",
                f"must be below mergeEverySteps (default {MERGE_EVERY_STEPS}): shifts happen between merges",
                ".shiftEverySteps"),
    )

    @model_validator(mode="after")
    def _merge_fields(self) -> "AveragingSpec":
        # Fields away from their defaults (a rendered manifest states every default: not an error).
        def changed(fields: tuple[str, ...]) -> str:
            names = [type(self).model_fields[name].alias or name for name in fields
                     if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)]
            return ", ".join(sorted(names))
        if self.mode not in ("parameters", "ties") and changed(MERGE_ONLY_FIELDS):
            raise ValueError(f"{changed(MERGE_ONLY_FIELDS)}: only for mode parameters or ties (mode is {self.mode})")
        if self.mode != "diloco" and changed(DILOCO_ONLY_FIELDS):
            raise ValueError(f"{changed(DILOCO_ONLY_FIELDS)}: only for mode diloco (mode is {self.mode})")
        if self.mode == "diloco" and self.compression == "blockwise8bit":
            raise ValueError("compression: diloco takes none, float16 or uniform8bit (blockwise8bit needs "
                             "bitsandbytes, which does not load here)")
        if self.trim is not None and self.mode != "ties":
            raise ValueError(f"trim: only for mode ties (mode is {self.mode})")
        if self.aggregation != "centeredClip" and self.centered_clip != CenteredClipSpec():
            raise ValueError(f"centeredClip: only for aggregation centeredClip (aggregation is {self.aggregation})")
        if self.aggregation == "centeredClip" and self.target_group_size is not None \
                and self.target_group_size < ROBUST_MIN_GROUP_SIZE:
            raise ValueError(f"targetGroupSize: centeredClip needs groups of at least {ROBUST_MIN_GROUP_SIZE} "
                             f"(of two, neither can be told hostile), got {self.target_group_size}")
        if self.merge_every_steps is not None and self.merge_every_epochs is not None:
            raise ValueError("set mergeEverySteps or mergeEveryEpochs, not both")
        merge_every = self.merge_every_steps or MERGE_EVERY_STEPS
        if self.shift_every_steps is not None and self.shift_every_steps >= merge_every \
                and self.merge_every_epochs is None:
            raise ValueError(f"shiftEverySteps ({self.shift_every_steps}) must be below mergeEverySteps "
                             f"({merge_every}): shifts happen between merges")
        return self


class MonitorSpec(SpecModel):
    # strict: 'yes' is an error here, as it is for the CRD
    enabled: StrictBool = Field(True, description="run the monitor: held-out evaluation, checkpoints, the run's end")
    eval_every_steps: int = Field(5, ge=1, description="evaluate held-out metrics every N global steps")
    checkpoint_every_steps: int = Field(20, ge=1, description="save the averaged model every N global steps")
    checkpoint_dir: Optional[str] = Field(
        None, description="checkpoints and the final model; default: RUN_DIR/checkpoints (in a cluster: where the "
                          "claim is mounted, with one)")
    keep_checkpoints: int = Field(3, ge=1, description="step-N.pt files kept; older ones are deleted")
    volume_claim: Optional[VolumeClaimSpec] = Field(
        None, description="cluster only: keep the checkpoints and the final model on a claim the operator makes "
                          "(NAME-checkpoints) and deletes with the Swarm, so a rescheduled monitor goes on numbering "
                          "from the last checkpoint and the final model outlives the pod (without a claim they live "
                          "in the pod's emptyDir)")
    existing_claim: Optional[str] = Field(
        None, pattern=DNS_SUBDOMAIN, max_length=253,
        description="cluster only: a PersistentVolumeClaim of yours instead; the operator never deletes it")
    placement: Placement = Field(default_factory=Placement)

    def directory(self, run_dir: str) -> str:
        return self.checkpoint_dir or f"{run_dir}/checkpoints"

    cel_rules = claim_rules("checkpointDir")

    @model_validator(mode="after")
    def _one_claim(self) -> "MonitorSpec":
        check_claim(self.volume_claim, self.existing_claim, self.checkpoint_dir, "checkpointDir", self.enabled)
        return self


# what a lab that joins this kind may run (spec.volunteers.labs)
LAB_ROLES = ("backbone", "trainer", "auxiliary")
# what a joining Swarm (spec.join) states itself: its peers, their hardware, place and reach
LAB_OWNED = ("join", "placement", "backbone", "trainers.replicas", "trainers.resources", "trainers.placement",
             "trainers.clientMode", "trainers.bandwidth", "trainers.network", "auxiliary")
# groups whose peers every other peer must be able to dial, and why
DIALED = {"backbone": "every peer bootstraps from the backbone", "auxiliary": "auxiliary peers only aggregate"}


class SwarmSpec(SpecModel):
    task: TaskSpec = Field(default_factory=TaskSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec,
                                     description="each replica's local optimizer (DiLoCo's inner one)")
    target_batch_size: int = Field(256, ge=1, description="global batch per optimizer step, whatever the peer count")
    backbone: BackboneSpec = Field(default_factory=BackboneSpec, description="the DHT peers every other peer "
                                                                             "bootstraps from")
    trainers: TrainerSpec = Field(default_factory=TrainerSpec, description="the peers that compute gradients")
    auxiliary: AuxiliarySpec = Field(default_factory=AuxiliarySpec,
                                     description="CPU-only peers that only help averaging (mode gradients)")
    averaging: AveragingSpec = Field(default_factory=AveragingSpec,
                                     description="how replicas combine: rounds, compression, aggregation, mode")
    monitor: MonitorSpec = Field(default_factory=MonitorSpec,
                                 description="evaluates the averaged model, keeps checkpoints, ends the run")
    balancer: BalancerSpec = Field(default_factory=BalancerSpec)
    stopping: StoppingSpec = Field(default_factory=lambda: StoppingSpec(target_steps=100),
                                   description="when the run is done")
    volunteers: VolunteersSpec = Field(default_factory=VolunteersSpec,
                                       description="let machines outside the cluster join, by token")
    placement: Placement = Field(default_factory=Placement, description="every pod's; merged under each group's")
    join: Optional[JoinSpec] = Field(None, description=JOIN_DESCRIPTION)

    lab_owned: ClassVar[tuple[str, ...]] = LAB_OWNED
    cel_rules = (
        lab_roles_rule(LAB_ROLES, "Swarm"),
        CelRule("self.trainers.batchSize <= self.targetBatchSize", "exceeds targetBatchSize", ".trainers.batchSize"),
        CelRule("!has(self.averaging.targetGroupSize) || self.volunteers.enabled || "
                "self.averaging.targetGroupSize <= self.trainers.replicas + self.auxiliary.replicas",
                "exceeds the averaging peers (trainers.replicas + auxiliary.replicas)", ".averaging.targetGroupSize"),
        CelRule("self.averaging.mode == 'gradients' || self.auxiliary.replicas == 0",
                "auxiliary peers help gradient averaging only (averaging.mode gradients); set it to 0",
                ".auxiliary.replicas"),
        CelRule("self.averaging.mode == 'gradients' || !has(self.balancer.enabled) || !self.balancer.enabled",
                "the balancer plans gradient averaging only (averaging.mode gradients)", ".balancer.enabled"),
        CelRule("!has(self.stopping.targetMetric) || self.monitor.enabled",
                "needs monitor.enabled: the monitor evaluates held-out metrics", ".stopping.targetMetric"),
        *(node_port_rule(group) for group in ("backbone", "trainers", "auxiliary")),
        *(not_client_only_rule(group, why) for group, why in DIALED.items()),
        CelRule(f"!self.trainers.clientMode || !(self.trainers.network.expose in {list(PUBLIC)})",
                "a client-mode trainer accepts no connection: it announces no public address", ".trainers.clientMode"),
    )

    @model_validator(mode="after")
    def _consistent(self) -> "SwarmSpec":
        if self.trainers.batch_size > self.target_batch_size:
            raise ValueError(
                f"trainers.batchSize ({self.trainers.batch_size}) exceeds targetBatchSize ({self.target_batch_size})"
            )
        group = self.averaging.target_group_size
        # volunteers are averaging peers the spec does not count: room for them is the point
        if group is not None and group > self.trainers.replicas + self.auxiliary.replicas and not self.volunteers.enabled:
            raise ValueError(
                f"averaging.targetGroupSize ({group}) exceeds the averaging peers "
                f"(trainers + auxiliary = {self.trainers.replicas + self.auxiliary.replicas})"
            )
        if self.averaging.merges_weights:
            mode = self.averaging.mode
            if self.auxiliary.replicas:
                raise ValueError(f"auxiliary.replicas: auxiliary peers help gradient averaging only "
                                 f"(averaging.mode is {mode}); set it to 0")
            if self.balancer.enabled:
                raise ValueError(f"balancer.enabled: the balancer plans gradient averaging only "
                                 f"(averaging.mode is {mode})")
        if self.balancer.enabled is None:
            self.balancer.enabled = not self.averaging.merges_weights
        if self.stopping.target_metric is not None and not self.monitor.enabled:
            raise ValueError("stopping.targetMetric needs monitor.enabled: the monitor evaluates held-out metrics")
        check_lab_roles(self.volunteers, LAB_ROLES, "Swarm")
        check_networks({"backbone": (self.backbone.network, self.backbone.replicas),
                        "trainers": (self.trainers.network, self.trainers.replicas),
                        "auxiliary": (self.auxiliary.network, self.auxiliary.replicas)}, DIALED,
                       self.volunteers.node_ports())
        if self.trainers.client_mode and self.trainers.network.public:
            raise ValueError("trainers.clientMode: a client-mode trainer accepts no connection: it announces no "
                             "public address")
        check_placements(self)
        check_join(self, LAB_OWNED, "Swarm")
        return self
