"""Distributed inference through BlockServer servers on loopback against the same blocks run
locally: greedy generation tokens/s with 1, 2 and 3 servers (the overhead ratio), over the
direct path and (rows "through p2pd") with every call through p2pd, with the per-hop breakdown
of one-token steps (the client's hop, the server's compute, the overhead between them),
forward throughput for a batch, and what wire compression (float16, blockwise 8-bit) and 8-bit
weights cost in speed, bytes and agreement with the exact model.

Anchor: Petals reports about 1 inference step/s for BLOOM-176B over 3 A100 servers (sections 3-4);
a 176B model spends far longer per block than a round trip. Here the blocks are tiny and the
honest measure is the ratio to local execution of the same blocks: it is the per-hop cost of
the network stack (p2pd, protobuf, asyncio) that a big model would amortize.
Prints a table and writes bench/results/block_inference.json.

    .venv/bin/python bench/bench_block_inference.py [--hidden 256] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

from bench_results import write_results
from hivekeeper.blocks import protocol
from hivekeeper.blocks.backend import SpanBackend
from hivekeeper.blocks.checkpoint import load_model, load_span
from hivekeeper.blocks.client import RemoteCausalLM, RemoteSequence, local_generate
from hivekeeper.blocks.quantize import quantize_weights, weight_bytes
from hivekeeper.spec import load_manifest

REPO = Path(__file__).resolve().parents[1]
BLOCKS = 6
CONFIGS = [  # name, spans, compression, weights, direct path (else every call through p2pd)
    ("1 server", ["0:6"], "none", "float32", True),
    ("1 server, through p2pd", ["0:6"], "none", "float32", False),
    ("2 servers", ["0:3", "3:6"], "none", "float32", True),
    ("3 servers", ["0:2", "2:4", "4:6"], "none", "float32", True),
    ("3 servers, through p2pd", ["0:2", "2:4", "4:6"], "none", "float32", False),
    ("3 servers, float16 wire", ["0:2", "2:4", "4:6"], "float16", "float32", True),
    ("3 servers, blockwise 8-bit wire", ["0:2", "2:4", "4:6"], "blockwise8bit", "float32", True),
    ("3 servers, int8 weights", ["0:2", "2:4", "4:6"], "none", "int8", True),
]


def manifest(tmp: Path, name: str, hidden: int, compression: str, weights: str) -> Path:
    document = yaml.safe_load((REPO / "examples/blockserver.yaml").read_text())
    document["metadata"]["name"] = name
    spec = document["spec"]
    spec["model"]["tiny"].update(hiddenSize=hidden, numLayers=BLOCKS, numHeads=max(1, hidden // 32))
    spec["compression"] = compression
    spec["servers"]["weights"] = weights
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def start_servers(path: Path, spans: list[str], peers: list[str], tmp: Path) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "hivekeeper", "run", "block-server", "--manifest", str(path),
                              "--index", str(i), "--run-dir", str(tmp), "--blocks", span, "--initial-peers", *peers],
                             stdout=open(tmp / f"{path.stem}-{i}.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)
            for i, span in enumerate(spans)]


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each server's process group (its p2pd too), SIGKILL what lingers."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls, and the last result."""
    seconds, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds), result


def hop_breakdown(log: list[dict]) -> dict:
    """Medians over one-token inference steps (RemoteSequence.hop_log): the client's whole hop,
    the server's compute, and the overhead between them, split into the server's part
    (queueing, decoding) and the rest (the wire both ways, both sides' encoding, the client's
    decoding)."""
    steps = [e for e in log if e["kind"] == "inference" and e.get("tokens") == 1 and "compute_ms" in e]
    if not steps:
        return {}

    def median(key) -> float:
        return round(statistics.median(key(e) for e in steps), 3)

    return {"steps": len(steps), "hopMs": median(lambda e: e["rpc_ms"]), "computeMs": median(lambda e: e["compute_ms"]),
            "overheadMs": median(lambda e: e["rpc_ms"] - e["compute_ms"]),
            "serverOverheadMs": median(lambda e: e["handler_ms"] - e["compute_ms"]),
            "wireAndCodecsMs": median(lambda e: e["rpc_ms"] - e["handler_ms"]),
            # of which the client's encoding and decoding; the rest is the wire and the server's framing
            "clientCodecsMs": median(lambda e: e["rpc_ms"] - e["call_ms"])}


def main() -> None:
    import hivemind

    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the forward batch (128 tokens each)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each server (servers.torchThreads: 1): one core per process either way
    prompt = torch.tensor([list(b"def fibonacci(n):")])
    batch_tokens = args.batch * 128

    results: dict = {"hidden": args.hidden, "blocks": BLOCKS, "newTokens": args.tokens, "configs": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_spec = load_manifest(manifest(tmp, "local", args.hidden, "none", "float32")).spec.model
        # Local: the same blocks, generation and a batched forward, in this process.
        full = load_model(model_spec)
        reference = local_generate(full, prompt, args.tokens)
        span = load_span(model_spec, 0, BLOCKS)
        batch = torch.randn(args.batch, 128, args.hidden)
        local_backend = SpanBackend(span, 10**6, 10**4, 60)

        def local_rates() -> tuple[float, float]:
            """Local tokens/s and forward tokens/s, measured next to each remote run: on a shared
            machine the load drifts, and a ratio is fair only within one time window."""
            generate, _ = timed(lambda: local_generate(full, prompt, args.tokens), args.repeats)
            forward, _ = timed(lambda: local_backend.forward(batch, 0, BLOCKS), args.repeats)
            return args.tokens / generate, batch_tokens / forward

        int8 = load_span(model_spec, 0, BLOCKS)
        quantize_weights(int8.blocks)
        results["weightBytes"] = {"float32": weight_bytes(span.blocks), "int8": weight_bytes(int8.blocks)}

        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peers = [str(a) for a in dht.get_visible_maddrs()]
        try:
            for k, (name, spans, compression, weights, direct) in enumerate(CONFIGS):
                path = manifest(tmp, f"bench-{k}", args.hidden, compression, weights)
                processes = start_servers(path, spans, peers, tmp)
                try:
                    deadline = time.monotonic() + 180
                    while len([s for s in protocol.read_servers(dht, path.stem) if s.state == protocol.ONLINE]) < len(spans):
                        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                            raise RuntimeError(f"{name}: servers did not come up; see {tmp}")
                        time.sleep(0.5)
                    client_dht = hivemind.DHT(initial_peers=peers, client_mode=True, start=True)
                    try:
                        sequence = RemoteSequence(client_dht, path.stem, BLOCKS, args.hidden, compression,
                                                  direct=direct)
                        model = RemoteCausalLM(model_spec, sequence)
                        model.generate(prompt, 2)  # warm-up: pings, connections
                        sequence.hop_log = []
                        seconds, tokens = timed(lambda: model.generate(prompt, args.tokens), args.repeats)
                        hops = hop_breakdown(sequence.hop_log)
                        sequence.hop_log = None
                        new, expected = tokens[0, prompt.shape[1]:], reference[0, prompt.shape[1]:]
                        forward, _ = timed(lambda: sequence.forward_span(batch, 0, BLOCKS)[0], args.repeats)
                        request = protocol.make_request(0, 1, [torch.randn(1, 1, args.hidden)], {"session": "x"},
                                                        compression)
                        tps, forward_tps = args.tokens / seconds, batch_tokens / forward
                        local_tps, local_forward_tps = local_rates()
                        results["configs"][name] = {
                            "servers": len(spans), "compression": compression, "weights": weights,
                            "tokensPerSecond": round(tps, 2), "localTokensPerSecond": round(local_tps, 2),
                            "overheadRatio": round(local_tps / tps, 2),
                            "msPerToken": round(1000 * seconds / args.tokens, 2),
                            "forwardTokensPerSecond": round(forward_tps, 1),
                            "localForwardTokensPerSecond": round(local_forward_tps, 1),
                            "forwardRatio": round(local_forward_tps / forward_tps, 2),
                            "tokensMatchingLocal": int((new == expected).cumprod(0).sum()),
                            "stepRequestBytes": len(request.SerializeToString()),
                            "path": "direct" if direct else "p2pd", "hops": hops,
                        }
                    finally:
                        client_dht.shutdown()
                finally:
                    stop(processes)
        finally:
            dht.shutdown()

    table = Table(title=f"Distributed generation vs local ({BLOCKS} blocks, hidden {args.hidden}, "
                        f"{args.tokens} greedy tokens; forward batch {args.batch}x128)")
    for column in ("config", "tokens/s", "local tokens/s", "local/remote", "hop ms", "compute ms", "overhead ms",
                   "forward tok/s", "local forward tok/s", "forward local/remote", "same tokens as local",
                   "step request bytes"):
        table.add_column(column, justify="left" if column == "config" else "right")
    for name, r in results["configs"].items():
        hops = r["hops"]
        table.add_row(name, f"{r['tokensPerSecond']:.1f}", f"{r['localTokensPerSecond']:.1f}",
                      f"{r['overheadRatio']:.2f}", f"{hops.get('hopMs', 0):.2f}", f"{hops.get('computeMs', 0):.2f}",
                      f"{hops.get('overheadMs', 0):.2f}", f"{r['forwardTokensPerSecond']:.0f}",
                      f"{r['localForwardTokensPerSecond']:.0f}", f"{r['forwardRatio']:.2f}",
                      f"{r['tokensMatchingLocal']}/{args.tokens}", str(r["stepRequestBytes"]))
    Console(width=190).print(table)
    weights = results["weightBytes"]
    print(f"weights of the {BLOCKS} blocks: float32 {weights['float32']} bytes, int8 {weights['int8']} bytes; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    write_results("block_inference", anchor="Petals: ~1 inference step/s for BLOOM-176B over 3 A100 servers; here: "
                                            "the ratio to local execution of the same blocks", **results)


if __name__ == "__main__":
    main()
