"""A p2pd flag hivemind 1.1.12 does not expose: `-relayDiscovery=0` for a peer given trusted relays.

With discovery on (p2pd's default), autorelay takes relay candidates from a peer source and
waits for 4 of them, or for its 3-minute boot delay, before it reserves a slot anywhere; and it
would reserve at any DHT peer that runs a relay service, not only the swarm's relays. With
discovery off, p2pd configures the trusted relays as static relays and reserves at once
(under a second in our runs)."""

from __future__ import annotations


def use_static_relays() -> None:
    """Make every P2P daemon this process (or a DHT process it forks) starts with autoRelay and
    trustedRelays use those relays only. Idempotent."""
    from hivemind.p2p.p2p_daemon import P2P

    original = P2P._make_process_args
    if getattr(original, "static_relays", False):
        return

    def make_process_args(*args, **kwargs):
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return original(*args, **kwargs)

    make_process_args.static_relays = True  # type: ignore[attr-defined]
    P2P._make_process_args = staticmethod(make_process_args)
