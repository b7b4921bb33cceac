"""Expert server role: hosts its share of the grid (`runtime.py`: requests checked, batched per
expert and run in this process, each backward request applied as an optimizer step), announces
its experts in the DHT with expiry (hivemind's DHTHandlerThread), and checkpoints its experts
so that a replacement resumes them."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path

import torch
from hivemind.moe.server.dht_handler import DHTHandlerThread

from hivekeeper.experts.backend import ExpertBackend, make_backend
from hivekeeper.experts.checkpoints import load_expert, save_expert
from hivekeeper.experts.common import PoolContext, load_pool_context
from hivekeeper.experts.grid import server_experts
from hivekeeper.experts.kind import SERVER
from hivekeeper.experts.runtime import ExpertRuntime
from hivekeeper.runtime.cpu import cores_given
from hivekeeper.runtime.lifecycle import install_signal_handlers

log = logging.getLogger("hivekeeper.experts.server")
REPORT_SECONDS = 1.0


def run(args: argparse.Namespace) -> int:
    ctx = load_pool_context(SERVER, args, signals=False)
    server = ExpertServer(ctx)
    if not server.uids:  # a volunteer (grid.volunteer_experts) where the servers hold the whole grid
        log.error(f"no free experts to hold: the servers hold all {ctx.spec.hosted_experts} of the grid "
                  "(servers.replicas x servers.expertsPerServer leaves no cell to volunteers)")
        return 2
    return server.run()


class ExpertServer:
    def __init__(self, ctx: PoolContext):
        self.ctx = ctx
        spec = ctx.spec
        self.uids = server_experts(spec, ctx.args.index)
        self.checkpoint_dir = Path(spec.checkpoint.directory(str(ctx.args.run_dir)))
        self.backends: dict[str, ExpertBackend] = {}
        self.saved_updates: dict[str, int] = {}
        self._save_lock = threading.Lock()

    def load_experts(self) -> dict[str, int]:
        """Create the experts, resuming each from its checkpoint where there is one."""
        resumed = {}
        for uid in self.uids:
            backend = make_backend(self.ctx.spec, uid)
            found = load_expert(self.checkpoint_dir, uid) if self.ctx.spec.checkpoint.enabled else None
            if found is not None:
                state, backend.updates = found
                backend.load_state_dict(state)
                resumed[uid] = backend.updates
            self.backends[uid] = backend
            self.saved_updates[uid] = backend.updates
        return resumed

    def save(self) -> int:
        """Checkpoint every expert updated since its last save; returns how many were written."""
        written = 0
        with self._save_lock:
            for uid, backend in self.backends.items():
                if backend.updates == self.saved_updates.get(uid) and (self.checkpoint_dir / f"{uid}.pt").exists():
                    continue
                state, updates = backend.snapshot()
                save_expert(self.checkpoint_dir, uid, state, updates)
                self.saved_updates[uid] = updates
                written += 1
        self.ctx.metrics.checkpoints.inc(written)
        return written

    def run(self) -> int:
        ctx, spec = self.ctx, self.ctx.spec
        torch.set_num_threads(cores_given(spec.servers.resources.cpu))
        ctx.start_endpoint()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what it forks keeps the default handlers
        dht = ctx.make_dht()
        log.info("joined the DHT", extra={"fields": {"peer_id": str(dht.peer_id)}})
        resumed = self.load_experts()
        runtime = ExpertRuntime(self.backends, spec.servers.max_batch_size,
                                device="cuda" if torch.cuda.is_available() else None)
        runtime.start(dht)
        announcer = DHTHandlerThread(self.backends, dht, update_period=spec.servers.announce_period_seconds,
                                     expiration=spec.servers.announce_expiration_seconds, daemon=True)
        announcer.start()
        install_signal_handlers(ctx.stop)  # after the DHT's process was forked: it keeps the default handlers
        ctx.metrics.experts_hosted.set(len(self.backends))
        if spec.checkpoint.enabled:
            self.save()  # fresh experts get a checkpoint at once: a replacement starts from the same weights
        log.info("expert server up", extra={"fields": {"peer_id": str(dht.peer_id), "experts": self.uids,
                                                       "resumed": resumed}})
        ctx.endpoint.ready.set()
        last_save = time.monotonic()
        try:
            while not ctx.stop.wait(REPORT_SECONDS):
                self.report(dht, resumed)
                if spec.checkpoint.enabled and time.monotonic() - last_save >= spec.checkpoint.every_seconds:
                    self.save()
                    last_save = time.monotonic()
        finally:
            ctx.endpoint.ready.clear()
            if spec.checkpoint.enabled:
                self.save()  # the latest updates survive a clean stop
            shutdown(runtime, announcer, dht)
        log.info("expert server stopped", extra={"fields": {"updates": {u: b.updates for u, b in self.backends.items()}}})
        return 0

    def report(self, dht, resumed: dict[str, int]) -> None:
        experts = {uid: {"updates": b.updates, "forwardBatches": b.forward_batches} for uid, b in self.backends.items()}
        for uid, entry in experts.items():
            self.ctx.metrics.expert_updates.labels(uid).set(entry["updates"])
            self.ctx.metrics.expert_forward_batches.labels(uid).set(entry["forwardBatches"])
        self.ctx.status.update(experts=experts, resumed=resumed, peerId=str(dht.peer_id),
                               served=sum(entry["forwardBatches"] for entry in experts.values()),
                               checkpointDir=str(self.checkpoint_dir))
        self.ctx.publish_report(dht, {"experts": sorted(experts)})


def shutdown(runtime: ExpertRuntime, announcer: DHTHandlerThread, dht) -> None:
    """Stop serving, then announcing: the announcing thread may be blocked on a DHT process that
    is already gone (killed with the role's process group, or crashed), so it is told to stop but
    not joined (it is a daemon)."""
    runtime.shutdown()
    announcer.stop.set()
    dht.shutdown()
