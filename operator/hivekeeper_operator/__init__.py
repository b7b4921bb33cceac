"""hivekeeper's Kubernetes operator: kopf handlers that turn Swarm (and, as they land,
BlockServer and ExpertPool) resources into pods through the same topology the local runner
uses. Its own source root (`operator/`), so no top-level package shadows the stdlib's
`operator` module."""

from hivekeeper import __version__

__all__ = ["__version__"]
