"""hivekeeper's Kubernetes operator: kopf handlers that turn Swarm, BlockServer and ExpertPool
resources into pods through the same role topology the local runner uses. Its own source root
(`operator/`), so no top-level package shadows the stdlib's `operator` module. It imports
neither torch nor hivemind (tests/test_operator_imports.py)."""

from hivekeeper import __version__

__all__ = ["__version__"]
