"""Every subclass and patch of hivemind's internals, for one hivemind version. The modules
override private methods and copy private logic of hivemind, so each checks the version at
import. Importing this package alone does not import hivemind."""

from __future__ import annotations

import os

__all__ = ["HIVEMIND_VERSION", "HivemindVersionError", "check_hivemind_version"]

HIVEMIND_VERSION = "1.1.12"  # the version every module here was written and tested against
ALLOW_ENV = "HIVEKEEPER_ALLOW_HIVEMIND_VERSION"  # "1": warn instead of failing (for porting to a new version)


class HivemindVersionError(ImportError):
    """The installed hivemind is not the one hivekeeper's extensions were written for."""


def check_hivemind_version(module: str) -> None:
    """Fail the import of `module` unless hivemind is HIVEMIND_VERSION.

    An error, not a warning: private signatures and step logic change between releases without
    notice, and the failures are silent (members that split a vector differently average garbage
    and report success; an override that no longer runs drops a finiteness check). A peer that
    refuses to start is cheaper than a swarm training on corrupt averages. ALLOW_ENV=1 makes it a
    warning, for porting these modules to a new release."""
    import hivemind

    found = getattr(hivemind, "__version__", "unknown")
    if found == HIVEMIND_VERSION:
        return
    message = (f"{module} was written for hivemind {HIVEMIND_VERSION}, but hivemind {found} is installed: "
               f"pip install hivemind=={HIVEMIND_VERSION}")
    if os.environ.get(ALLOW_ENV) == "1":
        import warnings

        warnings.warn(f"{message} ({ALLOW_ENV}=1: going on)", RuntimeWarning, stacklevel=2)
        return
    raise HivemindVersionError(f"{message} (or set {ALLOW_ENV}=1 to try anyway)")
