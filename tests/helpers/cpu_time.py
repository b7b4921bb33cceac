"""A pytest plugin that records each test's CPU time as the JUnit property `cpu_seconds`: the
test process's own and that of every process it started and waited for (with theirs, as each
waited), from setup to teardown. CI's closing table prints it beside the wall time: on two
saturated cores the wall time tells what waited, the CPU time what to cut.

A module-scoped fixture's set-up counts in its first test and its teardown in its last; pods of
the real cluster are no children of the test and do not count."""

from __future__ import annotations

import resource

import pytest

_STARTED = pytest.StashKey[float]()


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    item.stash[_STARTED] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield  # the teardown report, made after this hook, carries the property to the JUnit file
    if _STARTED in item.stash:
        item.user_properties.append(("cpu_seconds", round(cpu_seconds() - item.stash[_STARTED], 1)))
