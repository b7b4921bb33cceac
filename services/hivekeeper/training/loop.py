"""Pieces every training loop shares: shuffled batch indices, a throughput window, and the
cadence at which a peer reports itself and checks whether the run was ended."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Iterator, Optional

import numpy as np

from hivekeeper.runtime.context import RoleContext

log = logging.getLogger("hivekeeper.training")


def index_stream(train_size: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Shuffled passes over the data, a fresh permutation each pass; the last partial batch of a
    pass is dropped so every batch has the same size (hivemind weighs batches by count)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(train_size)
        for start in range(0, train_size - batch_size + 1, batch_size):
            yield order[start : start + batch_size].tolist()


def peer_seed(task_seed: int, index: int) -> int:
    """A replica's own batch order: distinct per replica, the same after its restart."""
    return task_seed * 10_007 + index + 1


class RateWindow:
    """Samples/s over the last `seconds` of finished batches (thread-safe: an ExpertPool trainer
    finishes batches on several threads). Batches added with the seconds spent computing them
    give the rate of computing instead: samples over those seconds, whatever the peer did in
    between (a Swarm trainer's averaging rounds)."""

    def __init__(self, seconds: float = 10.0):
        self.seconds = seconds
        self._records: deque[tuple[float, int, Optional[float]]] = deque()
        self._lock = threading.Lock()

    def add(self, samples: int, busy_seconds: Optional[float] = None) -> None:
        with self._lock:
            self._records.append((time.monotonic(), samples, busy_seconds))

    def rate(self) -> float:
        horizon = time.monotonic() - self.seconds
        with self._lock:
            while self._records and self._records[0][0] < horizon:
                self._records.popleft()
            records = list(self._records)
        if records and all(busy is not None for *_, busy in records):
            busy = sum(b for *_, b in records)
            return sum(n for _, n, _ in records) / busy if busy > 0 else 0.0
        span = records[-1][0] - records[0][0] if len(records) > 1 else 0.0
        return sum(n for _, n, _ in records[1:]) / span if span > 0 else 0.0


class ReportCadence:
    """Once every `interval` seconds of a training loop, `due(dht)` says whether to report, or
    returns False and sets `stopped` once the run's stop record appears (a Swarm's monitor
    wrote it): the loop then ends."""

    def __init__(self, ctx: RoleContext, interval: float = 1.0):
        self.ctx, self.interval = ctx, interval
        self._last = 0.0
        self.stopped: Optional[dict[str, Any]] = None

    def due(self, dht) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval:
            return False
        self._last = now
        self.stopped = self.ctx.stop_requested(dht)
        if self.stopped is not None:
            log.info("stop requested", extra={"fields": {"stop": self.stopped}})
            return False
        return True
