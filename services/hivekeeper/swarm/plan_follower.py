"""What trainers and auxiliaries do about the averaging plan: measure their bandwidth for the
balancer (probe at join, then every round), and follow the plan it signs.

A plan reaches the averager through `PlannedAverager.set_plan` and takes effect in the next
round that starts matchmaking; without a valid plan (none yet, expired, forged, or one that
does not name this peer) the averager keeps hivemind's default split.
"""

from __future__ import annotations

import logging
from typing import Optional

from hivemind.utils import get_dht_time

from hivekeeper.metrics import SwarmMetrics
from hivekeeper.runtime.bandwidth import BandwidthEstimate, Rates, peer_ids_of, probe
from hivekeeper.swarm.plan_record import PlanRecordError, SignedPlan, read_plan

log = logging.getLogger("hivekeeper.plan")


class PlanFollower:
    def __init__(self, dht, swarm: str, signer: Optional[str], averager, metrics: SwarmMetrics):
        self.dht, self.swarm, self.signer, self.averager, self.metrics = dht, swarm, signer, averager, metrics
        self.peer_id = str(dht.peer_id)
        self.plan: Optional[SignedPlan] = None
        self.bandwidth = BandwidthEstimate()
        self._applied: Optional[tuple[str, float]] = None  # digest and expiry given to the averager
        self._last_error: Optional[str] = None
        self._rounds_seen = 0

    def probe_bandwidth(self, initial_peers: list[str]) -> Optional[Rates]:
        rates = probe(self.dht, peer_ids_of(initial_peers))
        if rates is not None:
            log.info("bandwidth probe", extra={"fields": {"upload_Bps": round(rates.upload),
                                                          "download_Bps": round(rates.download)}})
            self._observe(rates)
        return rates

    def observe_rounds(self) -> None:
        """The rate this peer's latest all-reduce achieved (bytes it moved each way over its
        duration), once per new round."""
        last = self.averager.last_round
        if last is None or last.rounds == self._rounds_seen:
            return
        self._rounds_seen = last.rounds
        moved = self.averager.last_round_bytes.value
        if moved > 0 and last.seconds > 0:
            self._observe(Rates(moved / last.seconds, moved / last.seconds))

    def report(self) -> dict[str, Optional[float]]:
        """The measured rates, for the peer's DHT report: the balancer plans a peer it cannot
        scrape (a volunteer behind a NAT) from what the peer says there."""
        best = self.bandwidth.rates
        return {"uploadBytesPerSecond": best.upload if best else None,
                "downloadBytesPerSecond": best.download if best else None}

    def _observe(self, rates: Rates) -> None:
        self.bandwidth.observe(rates)
        best = self.bandwidth.rates
        if best is not None:
            self.metrics.upload_bytes_per_second.set(best.upload)
            self.metrics.download_bytes_per_second.set(best.download)

    def poll(self) -> Optional[SignedPlan]:
        """Read the plan from the DHT and hand a new or renewed one to the averager."""
        if self.signer is None:
            return None
        try:
            plan = read_plan(self.dht, swarm=self.swarm, signer=self.signer)
        except PlanRecordError as e:
            if str(e) != self._last_error:
                log.warning("no valid averaging plan; hivemind's split applies", extra={"fields": {"reason": str(e)}})
                self._last_error = str(e)
            # a plan already applied stays until its expiry (the averager checks it): a DHT
            # lookup that fails once, or a garbled record, does not cost a planned round
            if self.plan is not None and self.plan.expires <= get_dht_time():
                self.plan, self._applied = None, None
            return self.plan
        self._last_error = None
        if self._applied != (plan.digest, plan.expires):
            self.averager.set_plan(plan.shares(), plan.expires, group_size=plan.group_size)
            if self._applied is None or self._applied[0] != plan.digest:
                mine = plan.assignment(self.peer_id)
                log.info("following averaging plan", extra={"fields": {
                    "digest": plan.digest, "steps_per_second": round(plan.steps_per_second, 3),
                    "share": mine.share if mine else None,
                    "computes_gradients": mine.computes_gradients if mine else None}})
            self._applied = (plan.digest, plan.expires)
        self.plan = plan
        return plan

    @property
    def planned_rounds(self) -> int:
        """Rounds so far whose shares came from a plan (the rest used hivemind's split)."""
        last = self.averager.last_round
        return last.planned_rounds if last else 0

    @property
    def computes_gradients(self) -> bool:
        """The plan's c_i for this peer; peers a plan does not name keep computing."""
        mine = self.plan.assignment(self.peer_id) if self.plan else None
        return mine.computes_gradients if mine else True
