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


def test_a_downloaded_state_is_loaded_only_whole():
    """A state download cut short (or garbage from a donor) is refused, not half-loaded: hivemind
    raised IndexError on one whose optimizer statistics were missing."""
    from types import SimpleNamespace

    import torch
    from hivemind.optim.state_averager import dump_optimizer_state

    from hivekeeper.hivemind_ext.optimizer import _LoadedEpoch

    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    optimizer = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    statistics, statistic_tensors = dump_optimizer_state(optimizer)
    averager = SimpleNamespace(optimizer=optimizer, extra_tensors=())
    metadata = {"epoch": 4, "optimizer_metadata": statistics}
    whole = [p.detach() for p in params] + statistic_tensors

    def is_whole(meta, tensors) -> bool:
        return _LoadedEpoch._whole(averager, meta, tensors)

    assert is_whole(metadata, whole)
    assert not is_whole(metadata, whole[:-1])  # the stream ended one statistic early
    assert not is_whole(metadata, whole[:1])  # ... or within the parameters
    assert not is_whole({"epoch": 4}, whole)
    assert not is_whole({"epoch": 4, "optimizer_metadata": [{"type": "tensor", "index": "x"}]}, whole)
    assert not is_whole("garbage", whole) and not is_whole(metadata, None)


def test_a_loading_replica_waits_only_for_the_step_under_way_and_never_goes_back():
    """A state one step behind is downloaded again while its donor finishes the step. A state
    older than the replica's own (hivemind refuses it) or further behind ends the wait; when the
    newest state anyone holds is more than a step behind, the steps are lost and the replica goes
    on from the newest, so that a peer restarted from scratch at epoch 0 never becomes the model
    of a replica at epoch 5, and nobody loads state at every step forever."""
    from hivekeeper.hivemind_ext.optimizer import load_again, lost_steps

    assert load_again(held=4, loaded=6, global_epoch=7)  # taken, one step behind: wait for the step
    assert not load_again(held=0, loaded=0, global_epoch=7)  # the newest there is: waiting brings nothing
    assert not load_again(held=6, loaded=0, global_epoch=7)  # refused: older than its own
    assert not load_again(held=5, loaded=7, global_epoch=7)  # current
    assert not load_again(held=5, loaded=None, global_epoch=7)  # nobody shares a state
    assert lost_steps(held=0, loaded=0, global_epoch=7) and lost_steps(held=5, loaded=0, global_epoch=7)
    assert not lost_steps(held=6, loaded=0, global_epoch=7)  # its own is one behind: hivemind catches up
    assert not lost_steps(held=0, loaded=6, global_epoch=7) and not lost_steps(held=0, loaded=None, global_epoch=7)
