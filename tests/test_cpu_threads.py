"""The torch threads of servers follow the cores their container is given."""

from __future__ import annotations

import pytest

from hivekeeper.runtime import cpu
from hivekeeper.spec.quantity import quantity_value


@pytest.mark.parametrize("text, value", [("500m", 0.5), (2, 2.0), ("1.5", 1.5), ("2Gi", 2 * 1024 ** 3),
                                         ("1e3", 1000.0), ("1k", 1000.0), (".5", 0.5)])
def test_quantity_values(text, value):
    assert quantity_value(text) == value


def test_a_bad_quantity_is_refused():
    with pytest.raises(ValueError, match="Kubernetes quantity"):
        quantity_value("two")


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(cpu, "usable_cpus", lambda: 4)


def write_v2(root, text):
    (root / "cpu.max").write_text(text)
    return root


def test_cgroup_v2_limit(tmp_path, four_cpus):
    assert cpu.cgroup_cpu_limit(write_v2(tmp_path, "250000 100000\n")) == 2.5
    assert cpu.cores_given(None, tmp_path) == 3  # a fraction of a core still gets a thread
    assert cpu.cores_given("2", tmp_path) == 2  # the request, below the limit


def test_cgroup_v2_without_a_limit(tmp_path, four_cpus):
    write_v2(tmp_path, "max 100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) is None
    assert cpu.cores_given("2", tmp_path) == 2
    assert cpu.cores_given("500m", tmp_path) == 1
    assert cpu.cores_given("16", tmp_path) == 4  # never more than the CPUs it may run on
    assert cpu.cores_given(None, tmp_path) == 4


def test_cgroup_v1_quota(tmp_path, four_cpus):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu.cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu.cgroup_cpu_limit(tmp_path) is None


def test_no_cgroup_files(tmp_path, four_cpus):
    assert cpu.cgroup_cpu_limit(tmp_path) is None
    assert cpu.cores_given("3", tmp_path) == 3


def test_an_explicit_thread_count_wins():
    assert cpu.torch_threads(5, "1") == 5
