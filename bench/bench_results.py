"""Where and how every benchmark writes its JSON: bench/results/NAME.json, with the anchor it
compares against and the machine it ran on (cores, load average: timings on a shared 2-core
machine mean little without them)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version()}


def write_results(name: str, anchor: str, **payload: Any) -> Path:
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"anchor": anchor, "machine": machine(), **payload}, indent=2))
    print(f"wrote {path}")
    return path
