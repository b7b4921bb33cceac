"""A resource that joins another lab's swarm (spec.join), on the operator's side.

The host's token service says what the swarm computes: the operator asks it with the lab's
invite (`hivekeeper.auth.probe`, in a process of its own: the operator never imports hivemind)
and joins the host's manifest with the lab's own fields (`spec.join` names which). The lab runs
only its contribution: the kind's roles a lab may run (those with a `lab_role`: a Swarm's
backbone, trainers and auxiliaries; a BlockServer's backbone and servers; an ExpertPool's
backbone, expert servers and trainers), numbered apart from everyone else's
(`topology.lab_index_base`), bootstrapping from the host's entry points as well as the lab's own
backbone, each asking the host's token service for its own token with the lab's invite.

Whatever goes wrong ends in the Joined condition with a reason (`REASONS`) and an Event, never
in crash-looping pods: a gateway that does not answer leaves the lab's peers running (they
retry, as the host's do), any other refusal stops them."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hivekeeper.errors import UserError
from hivekeeper.kinds import KindRuntime
from hivekeeper.spec import Manifest, parse_manifest
from hivekeeper.spec.join import INVITE_KEY
from hivekeeper.spec.volunteers import VolunteersSpec

PROBE_SECONDS = 30.0  # the probe process: start (hivemind, torch) and the gateway's answer
REPROBE_SECONDS = 60.0  # a joined resource asks again this often (a revoked invite shows within a minute)
RETRY_SECONDS = 15.0  # a resource that is not joined asks again this often

# The Joined condition's reasons, besides the probe's own (hivekeeper.auth.probe.REASONS)
JOINED = "Joined"
INVITE_MISSING = "InviteMissing"
HOST_KIND_MISMATCH = "HostKindMismatch"
HOST_TASK_UNSUPPORTED = "HostManifestUnsupported"
UNREACHABLE = "GatewayUnreachable"

# (gateway, invite) -> the probe's answer: {"identity", "swarm"} or {"reason", "message"}
Prober = Callable[[str, str], dict[str, Any]]


@dataclass(frozen=True)
class HostSwarm:
    """The swarm a lab joins, as this lab runs its part."""

    identity: str  # the lab, as its invite names it
    name: str  # the host's resource: the swarm's run id
    manifest: Manifest  # what the operator plans from: named as the joining resource, its volunteers off
    document: dict[str, Any]  # what the lab's pods read: the host's manifest with the lab's fields
    entry_points: tuple[str, ...]  # where the lab's peers reach the host's DHT (its relays)
    plan_signer: Optional[str]  # whose averaging plan the lab's peers follow


@dataclass(frozen=True)
class JoinOutcome:
    host: Optional[HostSwarm]
    reason: str  # the Joined condition's
    message: str

    @property
    def keeps_peers(self) -> bool:
        """Whether the lab's peers stay as they are: only a gateway that does not answer (a
        partition, a host restarting) leaves them be; they retry on their own."""
        return self.host is None and self.reason == UNREACHABLE


def subprocess_prober(gateway: str, invite: str) -> dict[str, Any]:
    """Runs the probe in a process of its own (the invite in a file only this user reads)."""
    fd, path = tempfile.mkstemp(prefix="hivekeeper-invite-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(invite)
        try:
            done = subprocess.run([sys.executable, "-m", "hivekeeper.auth.probe", gateway, path],
                                  capture_output=True, text=True, timeout=PROBE_SECONDS)
        except subprocess.TimeoutExpired:
            return {"reason": UNREACHABLE, "message": f"the token service at {gateway} did not answer within "
                                                      f"{PROBE_SECONDS:.0f} s"}
    finally:
        os.unlink(path)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the gateway probe failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def join(joining: Manifest, answer: dict[str, Any]) -> JoinOutcome:
    """What a probe's answer means for the joining resource."""
    if "reason" in answer:
        return JoinOutcome(None, str(answer["reason"]), str(answer.get("message", "")))
    swarm = answer.get("swarm") or {}
    if swarm.get("kind") != joining.kind:
        return JoinOutcome(None, HOST_KIND_MISMATCH, f"the invite admits to {swarm.get('kind')} "
                                                     f"{swarm.get('name')!r}, and this is a {joining.kind}")
    name = str(swarm.get("name"))
    hosted_document = {"apiVersion": joining.api_version, "kind": joining.kind, "metadata": {"name": name},
                       "spec": copy.deepcopy((swarm.get("manifest") or {}).get("spec") or {})}
    lab_owned = [path for path in type(joining.spec).lab_owned if path != "join"]
    # what the pods read leaves the host's counts (the lab's are its own business)
    read = [path for path in lab_owned if path != "backbone" and not path.endswith("replicas")]
    try:
        hosted = parse_manifest(hosted_document, source=f"the host's {joining.kind} {name!r}")
        document = {**hosted_document, "spec": _with(hosted.spec, joining.spec, read).model_dump(
            by_alias=True, mode="json", exclude_none=True)}
        parse_manifest(copy.deepcopy(document), source=f"the host's {joining.kind} {name!r} with this lab's fields")
    except UserError as e:
        return JoinOutcome(None, HOST_TASK_UNSUPPORTED, f"this lab cannot run the host's swarm: {e}")
    # The lab's counts, its join and a closed door: the operator's plan, never validated as a
    # manifest (a joining lab's may, say, run no trainer of an ExpertPool).
    spec = _with(hosted.spec, joining.spec, lab_owned).model_copy(
        update={"join": joining.spec.join, "volunteers": VolunteersSpec()})
    planned = hosted.model_copy(update={"metadata": joining.metadata, "spec": spec})
    host = HostSwarm(identity=str(answer.get("identity")), name=name, manifest=planned, document=document,
                     entry_points=tuple(swarm.get("initialPeers") or ()), plan_signer=swarm.get("planSigner"))
    return JoinOutcome(host, JOINED, f"lab {host.identity!r} takes part in {joining.kind} {host.name!r} "
                                     f"through {joining.spec.join.gateway}")


def lab_components(kind: KindRuntime) -> set[str]:
    """The components a lab may run: those whose role asks for a token as a lab role."""
    return {component for component, entry in kind.role_modules.items() if entry.lab_role is not None}


def invite_of(secret: Optional[dict[str, Any]], secret_name: str) -> tuple[Optional[str], str]:
    """The invite in the user's Secret, or why there is none."""
    data = (secret or {}).get("data") or {}
    if secret is None:
        return None, f"Secret {secret_name!r} (spec.join.inviteSecret) does not exist"
    if INVITE_KEY not in data:
        return None, f"Secret {secret_name!r} has no key {INVITE_KEY!r} (the invite the host minted for this lab)"
    try:
        return base64.b64decode(data[INVITE_KEY]).decode().strip(), ""
    except (ValueError, UnicodeDecodeError):
        return None, f"Secret {secret_name!r}: key {INVITE_KEY!r} is not text"


class ProbeCache:
    """One probe per resource and invite a while: a probe costs a process that imports hivemind,
    and the operator reconciles every resource every few seconds."""

    def __init__(self, prober: Prober, clock: Callable[[], float] = time.monotonic):
        self.prober, self.clock = prober, clock
        self._answers: dict[tuple[str, str], tuple[str, float, dict[str, Any]]] = {}

    def answer(self, resource: tuple[str, str], gateway: str, invite: str) -> dict[str, Any]:
        key = hashlib.sha256(f"{gateway}\0{invite}".encode()).hexdigest()
        cached = self._answers.get(resource)
        if cached is not None and cached[0] == key:
            wait = REPROBE_SECONDS if "reason" not in cached[2] else RETRY_SECONDS
            if self.clock() - cached[1] < wait:
                return cached[2]
        answer = self.prober(gateway, invite)
        self._answers[resource] = (key, self.clock(), answer)
        return answer

    def forget(self, resource: tuple[str, str]) -> None:
        self._answers.pop(resource, None)


def _with(spec: Any, source: Any, paths: list[str]) -> Any:
    """A copy of the spec model `spec` with the fields at `paths` (camelCase, dotted) taken
    from `source`, a spec of the same kind, as they are: nothing is validated again."""
    out = spec.model_copy(deep=True)
    for path in paths:
        *parents, last = path.split(".")
        target, origin = out, source
        for part in parents:
            target, origin = getattr(target, _attribute(target, part)), getattr(origin, _attribute(origin, part))
        name = _attribute(target, last)
        object.__setattr__(target, name, copy.deepcopy(getattr(origin, name)))  # unvalidated: see the callers
    return out


def _attribute(model: Any, alias: str) -> str:
    return next(name for name, info in type(model).model_fields.items() if (info.alias or name) == alias)
