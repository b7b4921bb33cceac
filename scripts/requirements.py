#!/usr/bin/env python3
"""Prints the requirements pyproject.toml declares, one per line: the build system's, the
project's dependencies and the named extras. scripts/install.sh fills the wheelhouse and the
venv from this list, and cluster/image/build.sh hands the same wheelhouse to the image build.

    scripts/requirements.py [EXTRA,...]      e.g. scripts/requirements.py test,operator
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())
    optional = project["project"].get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"requirements.py: no such extra in pyproject.toml: {', '.join(unknown)}")
    found = [*project["build-system"]["requires"], *project["project"]["dependencies"]]
    for extra in extras:
        found += optional[extra]
    return list(dict.fromkeys(found))  # once each, in order


if __name__ == "__main__":
    print("\n".join(requirements([e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e])))
