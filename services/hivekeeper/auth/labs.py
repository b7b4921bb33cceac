"""Labs on a swarm's allowlist: a party that pools a cluster's peers into the swarm with one
invite. The token service gives each of the lab's peers a token of its own (for that peer's key),
for the roles the lab may run, and never more than `maxPeers` of its peers hold a live token at
once. A token names its holder's role (`SUBJECT` below), so a peer's role is the swarm key's word,
not the peer's.

The allowlist file (a Secret's `allowlist` key, re-read when it changes) lists an identity a line;
a line with settings names a lab:

    carol                                      # one volunteer
    lab-b maxPeers=8 roles=trainer,backbone    # a lab

Removing a lab's line (or its entry in the manifest) refuses its next renewals: every one of its
peers is cut off within one token lifetime."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from hivekeeper.spec.volunteers import LAB_NAME_PATTERN, LAB_ROLES

SUBJECT_SEPARATOR = "/"  # a token's subject: IDENTITY, or IDENTITY/ROLE for a peer that named its role
MAX_PEER_NAME = 253  # a pod's name at most


@dataclass(frozen=True)
class Lab:
    name: str
    max_peers: int
    roles: frozenset[str]


@dataclass(frozen=True)
class AccessList:
    """Who may get a token: single identities, and labs by name."""

    identities: frozenset[str] = frozenset()
    labs: Mapping[str, Lab] = field(default_factory=dict)

    def names(self) -> frozenset[str]:
        return self.identities | frozenset(self.labs)

    def merged(self, other: "AccessList") -> "AccessList":
        """Both lists; a name that is a lab in either is that lab (`other`'s settings win)."""
        labs = {**self.labs, **other.labs}
        return AccessList((self.identities | other.identities) - frozenset(labs), labs)


def parse_access_list(text: str) -> AccessList:
    """The allowlist file's content; ValueError naming the line for a lab line that does not read."""
    identities, labs = set(), {}
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) == 1:
            identities.add(words[0])
            continue
        try:
            lab = _lab(words)
        except ValueError as e:
            raise ValueError(f"line {number}: {e} (a lab's line: NAME maxPeers=N roles=ROLE,ROLE)") from None
        if lab.name in labs:
            raise ValueError(f"line {number}: lab {lab.name!r} is listed twice")
        labs[lab.name] = lab
    return AccessList(frozenset(identities) - frozenset(labs), labs)


def _lab(words: list[str]) -> Lab:
    name, settings = words[0], {}
    if not re.fullmatch(LAB_NAME_PATTERN, name):
        raise ValueError(f"{name!r} is not a lab name (a DNS label: lower-case letters, digits, '-')")
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in ("maxPeers", "roles") or key in settings:
            raise ValueError(f"{word!r} is not one of maxPeers=N, roles=...")
        settings[key] = value
    if set(settings) != {"maxPeers", "roles"}:
        raise ValueError(f"lab {name!r} needs maxPeers and roles")
    if not settings["maxPeers"].isdigit() or int(settings["maxPeers"]) < 1:
        raise ValueError(f"maxPeers={settings['maxPeers']!r} is not a whole number of at least 1")
    roles = settings["roles"].split(",")
    unknown = [role for role in roles if role not in LAB_ROLES]
    if unknown or not roles:
        raise ValueError(f"roles: {', '.join(unknown) or 'none'}: each is one of {', '.join(LAB_ROLES)}")
    return Lab(name, int(settings["maxPeers"]), frozenset(roles))


def labs_of(specs: Iterable) -> dict[str, Lab]:
    """The manifest's `volunteers.labs` as Labs."""
    return {spec.name: Lab(spec.name, spec.max_peers, frozenset(spec.roles)) for spec in specs}


def token_subject(identity: str, role: Optional[str]) -> str:
    return f"{identity}{SUBJECT_SEPARATOR}{role}" if role else identity


def split_subject(subject: str) -> tuple[str, Optional[str]]:
    """(identity, role) of a token's subject; role None for a token that names none."""
    identity, sep, role = subject.rpartition(SUBJECT_SEPARATOR)
    return (identity, role) if sep and role in LAB_ROLES else (subject, None)


class QuotaExceeded(Exception):
    def __init__(self, lab: Lab, held: int, frees_in: float):
        super().__init__(f"lab {lab.name!r} has {held} peers holding a token, its quota (maxPeers {lab.max_peers}); "
                         f"a slot frees when one of their tokens runs out (in {frees_in:.0f} s at most) or when "
                         "the host raises maxPeers")
        self.lab, self.held = lab, held


class PeerQuota:
    """Which of each lab's peers hold a live token: peer name -> the expiry of its latest token.
    A peer that renews (or restarts with a new key under its name) keeps its one slot; a slot frees
    when its token runs out. Held in the token service's memory: after a restart the count builds
    up again from the renewals, which come within a quarter of a token lifetime."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, float]] = {}

    def take(self, lab: Lab, peer: str, expires_at: float, now: Optional[float] = None) -> None:
        """Counts `peer`'s token until `expires_at`, or raises QuotaExceeded."""
        now = time.time() if now is None else now
        with self._lock:
            held = {name: until for name, until in self._held.get(lab.name, {}).items() if until > now}
            if peer not in held and len(held) >= lab.max_peers:
                raise QuotaExceeded(lab, len(held), min(held.values()) - now)
            held[peer] = max(expires_at, held.get(peer, 0.0))
            self._held[lab.name] = held

    def held(self, now: Optional[float] = None) -> dict[str, int]:
        """Peers with a live token, by lab."""
        now = time.time() if now is None else now
        with self._lock:
            return {lab: sum(until > now for until in peers.values()) for lab, peers in self._held.items()}
