"""hivekeeper's hivemind extensions refuse a hivemind other than the one they were written for."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import hivekeeper.hivemind_ext as ext


def test_the_version_guard_fires_for_another_hivemind_and_names_the_module(monkeypatch):
    import hivemind

    module = importlib.import_module("hivekeeper.hivemind_ext.p2pd")
    monkeypatch.setattr(hivemind, "__version__", "1.2.0")
    monkeypatch.delenv(ext.ALLOW_ENV, raising=False)
    with pytest.raises(ext.HivemindVersionError,
                       match=r"hivekeeper\.hivemind_ext\.p2pd was written for hivemind 1\.1\.12, but hivemind 1\.2\.0"):
        importlib.reload(module)
    monkeypatch.setenv(ext.ALLOW_ENV, "1")  # porting: a warning, and the module loads
    with pytest.warns(RuntimeWarning, match="hivemind 1.2.0 is installed"):
        importlib.reload(module)


def test_every_module_checks_the_version_at_import():
    folder = Path(ext.__file__).parent
    for info in pkgutil.iter_modules([str(folder)]):
        source = (folder / f"{info.name}.py").read_text()
        assert "check_hivemind_version(__name__)" in source, info.name


def test_subclasses_keep_the_rpc_names_peers_meet_under():
    """hivemind names RPC handlers after the servicer's class: the Swarm's state averager must
    answer a plain TrainingStateAverager (the monitor's), and the gradient averager keeps the
    name the Swarm's peers have used."""
    from hivemind.optim.state_averager import TrainingStateAverager

    from hivekeeper.hivemind_ext.allreduce import CountingGradientAverager, PlannedCountingGradientAverager, planned
    from hivekeeper.hivemind_ext.optimizer import FiniteStateAverager

    name = "run_state_averager", "rpc_download_state"
    assert FiniteStateAverager._get_handle_name(*name) == TrainingStateAverager._get_handle_name(*name)
    assert PlannedCountingGradientAverager.__name__ == planned(CountingGradientAverager).__name__
