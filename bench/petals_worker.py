"""Petals' side of bench_petals.py, run by the Python of Petals' own venv (.petals-venv/):
never imported by hivekeeper, and it imports nothing of hivekeeper's.

    petals_worker.py dht                   a bootstrap DHT peer: prints {"maddrs": [...]}, runs until killed
    petals_worker.py server ARGS...        petals.cli.run_server with ARGS
    petals_worker.py client MODEL PREFIX PEER...
        a client that reads one JSON command a line on stdin and answers one JSON line
        (marked with ANSWER) on stdout:
        {"cmd": "wait", "blocks": N, "timeout": S}       until every block is served by an online server
        {"cmd": "generate", "prompt": [ids], "new_tokens": N}
            -> {"tokens": [ids], "ttft": s, "seconds": s}  (greedy, one inference session)

Nothing goes to the network: Petals' version check (a PyPI query) is skipped, the throughput
is given (no speedtest), the reachability check is skipped, the model is a local folder.

Two compatibility shims, applied before Petals is imported, for torch 2.13 (the torch pinned
here; Petals 2.2's own pins predate it):
- hivemind 1.1.10.post2 imports `_refresh_per_optimizer_state` from `torch.cuda.amp.grad_scaler`,
  which torch 2.13 keeps in `torch.amp.grad_scaler` only: it is put back (hivemind's optimizer
  uses it; Petals' serving and inference never run that code);
- bitsandbytes 0.41.1 imports `triton.ops` whenever a triton is installed, and the triton that
  torch 2.13 brings has no `ops`: bitsandbytes is imported with triton hidden from it (its triton
  kernels are for GPUs; Petals on the CPU with quant_type none never calls them)."""

from __future__ import annotations

import json
import sys
import time

ANSWER = "@@petals@@ "


def _shim() -> None:
    import importlib.util

    import torch  # noqa: F401 (before triton is hidden below)
    import torch.amp.grad_scaler as moved
    import torch.cuda.amp.grad_scaler as old

    if not hasattr(old, "_refresh_per_optimizer_state"):
        old._refresh_per_optimizer_state = moved._refresh_per_optimizer_state
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, package=None: None if name == "triton" else find_spec(name, package)
    try:
        import bitsandbytes  # noqa: F401
    finally:
        importlib.util.find_spec = find_spec


def answer(value: dict) -> None:
    sys.stdout.write(ANSWER + json.dumps(value) + "\n")
    sys.stdout.flush()


def dht() -> None:
    _shim()
    import hivemind

    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    answer({"maddrs": [str(a) for a in node.get_visible_maddrs()]})
    try:
        while True:
            time.sleep(3600)
    finally:
        node.shutdown()


def server(args: list[str]) -> None:
    _shim()
    from petals.cli import run_server

    run_server.validate_version = lambda: None  # it asks PyPI for Petals' latest version: no network at run time
    sys.argv = ["run_server", *args]
    run_server.main()


class _FirstToken:
    """A transformers streamer: put() gets the prompt first, then each new token."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def client(model_path: str, prefix: str, peers: list[str]) -> None:
    _shim()
    import torch

    torch.set_num_threads(1)
    from petals import AutoDistributedModelForCausalLM
    from petals.data_structures import ServerState
    from petals.utils.dht import get_remote_module_infos

    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=peers, dht_prefix=prefix, torch_dtype=torch.float32)
    model.eval()
    answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "wait":
            deadline = time.monotonic() + command["timeout"]
            uids = [f"{prefix}.{i}" for i in range(command["blocks"])]
            while True:
                infos = get_remote_module_infos(model.transformer.h.sequence_manager.dht, uids, latest=True)
                if all(info is not None and any(s.state == ServerState.ONLINE for s in info.servers.values())
                       for info in infos):
                    answer({"online": True})
                    break
                if time.monotonic() > deadline:
                    answer({"online": False})
                    break
                time.sleep(0.5)
        elif command["cmd"] == "generate":
            prompt = torch.tensor([command["prompt"]])
            streamer = _FirstToken()
            began = time.perf_counter()
            with torch.inference_mode():
                tokens = model.generate(prompt, max_new_tokens=command["new_tokens"], do_sample=False,
                                        streamer=streamer, pad_token_id=0)
            ended = time.perf_counter()
            answer({"tokens": tokens[0].tolist(), "ttft": streamer.first - began, "seconds": ended - began,
                    "decode_seconds": ended - streamer.first})
        elif command["cmd"] == "quit":
            break


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "dht":
        dht()
    elif what == "server":
        server(rest)
    elif what == "client":
        client(rest[0], rest[1], rest[2:])
    else:
        raise SystemExit(f"unknown command {what!r}")
