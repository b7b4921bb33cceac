"""Stable libp2p identities for backbone peers: a key file per peer, made once, whose peer ID
others can put in their bootstrap multiaddrs before the peer even starts."""

from __future__ import annotations

from pathlib import Path


def ensure_identity(path: Path) -> str:
    """Create the private key at `path` if it does not exist; return its base58 peer ID."""
    from hivemind.p2p import P2P, PeerID

    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        P2P.generate_identity(str(path))
        path.chmod(0o600)
    return PeerID.from_identity(path.read_bytes()).to_base58()
