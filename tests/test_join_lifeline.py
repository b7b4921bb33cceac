"""`hivekeeper join` killed with SIGKILL leaves no p2pd of its own running: the relay watchdog's
daemon (started from the watchdog's thread) and the connectivity check's carry the parent-death
signal. (Its role stops by itself once the fork server is gone: tests/test_role_kill.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import wait_for
from helpers.processes import kill_all, tree, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")

# What `join` does before its role runs, as far as p2pd goes: the check from the main thread,
# then the watchdog's daemon from its own thread (no relay answers: the checks just fail).
JOIN = """
import asyncio, sys, time
from hivemind.p2p import P2P
from hivekeeper.volunteer.join import p2pd_dies_with_this_process
from hivekeeper.volunteer.watchdog import RelayWatchdog

p2pd_dies_with_this_process()

async def check():
    return await P2P.create(no_listen=True, auto_nat=False, nat_port_map=False, dht_mode="client")

loop = asyncio.new_event_loop()
main_p2p = loop.run_until_complete(check())
watchdog = RelayWatchdog([], "QmNobody", interval=0.2).start()
while watchdog.checks == 0:
    time.sleep(0.1)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_join_killed_leaves_no_p2pd_of_its_own(no_leaked_p2pd):
    join = subprocess.Popen([sys.executable, "-c", JOIN], stdout=subprocess.PIPE, text=True)
    started = []
    try:
        assert join.stdout is not None and join.stdout.readline().strip() == "ready"
        started = wait_for(lambda: (found := [p for p in tree(join.pid) if p.comm == "p2pd"]) and len(found) == 2
                           and found, 30, "the check's and the watchdog's p2pd")
        os.kill(join.pid, signal.SIGKILL)
        join.wait(10)
        assert not wait_gone(started, 10), "a p2pd outlived join"
    finally:
        kill_all([*started, *tree(join.pid)])
        if join.poll() is None:
            join.kill()
            join.wait(10)
