"""Is a relayed volunteer still reachable? Every `interval` seconds a relay is asked to dial the
volunteer's role back through its /p2p-circuit address (the same dial-back check `join` runs
first), from a daemon of the watchdog's own. A role that was reachable and has not been for
`grace` seconds, or never was within `startup_grace`, is due a restart: its libp2p host then
reserves a slot at the relay afresh (a relay that restarts forgets every reservation)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Optional, Sequence

from hivekeeper.hivemind_ext.p2pd import STOPS_ITS_P2PD
from hivekeeper.volunteer.reachability import ask

INTERVAL = 10.0
GRACE = 30.0
STARTUP_GRACE = 120.0  # a trainer loads the model and the swarm's state before it bootstraps


class RelayWatchdog:
    def __init__(self, relays: Sequence[str], peer_id: str, interval: float = INTERVAL, grace: float = GRACE,
                 startup_grace: float = STARTUP_GRACE):
        self.relays, self.peer_id = list(relays), peer_id
        self.interval, self.grace, self.startup_grace = interval, grace, startup_grace
        self.checks = self.failures = 0
        self.last_ok: Optional[float] = None  # monotonic time of the latest successful dial-back
        self.reachable_since: Optional[float] = None  # wall time of the latest success after none
        self._since = time.monotonic()  # when the role (re)started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="relay-watchdog", daemon=True)
        setattr(self._thread, STOPS_ITS_P2PD, True)  # _main stops its daemon before the thread ends

    def start(self) -> "RelayWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def role_restarted(self) -> None:
        self._since, self.last_ok = time.monotonic(), None

    @property
    def reachable(self) -> bool:
        return self.last_ok is not None and time.monotonic() - self.last_ok < self.interval + self.grace

    def restart_due(self) -> bool:
        now = time.monotonic()
        if self.last_ok is None:
            return now - self._since > self.startup_grace
        return now - max(self.last_ok, self._since) > self.grace

    async def _main(self) -> None:
        from hivemind.p2p import P2P

        p2p = await P2P.create(no_listen=True, auto_nat=False, nat_port_map=False, dht_mode="client")
        try:
            while not self._stop.is_set():
                if await self._check(p2p):
                    if not self.reachable:
                        self.reachable_since = time.time()
                    self.last_ok = time.monotonic()
                else:
                    self.failures += 1
                self.checks += 1
                await asyncio.get_running_loop().run_in_executor(None, self._stop.wait, self.interval)
        finally:
            await p2p.shutdown()

    async def _check(self, p2p) -> bool:
        for relay in self.relays:
            try:
                if (await ask(p2p, relay, [f"{relay}/p2p-circuit"], peer=self.peer_id)).reachable:
                    return True
            except Exception:  # the relay is down or restarting
                continue
        return False
