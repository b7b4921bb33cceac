"""BlockServer against Petals 2.2, side by side on this machine: the same random-weight Llama
checkpoint (a local Hugging Face folder built once per run, float32), the same spans on the
same loopback, greedy decoding through 1 server and through 2. Both systems' servers run at
once; generations alternate between Petals' client, hivekeeper's client over the direct path
and hivekeeper's client through p2pd (the path calls take where the direct one is out of reach), in an
order that rotates each round, so each sees the machine's load of the same minutes.

Reported per configuration (medians over the rounds): decode tokens/s (the tokens after the
first, over the time after the first), time to first token (generate() called to the first new
token: prefill of the prompt through the chain, and the first token), whether the tokens equal
each other's and the whole model's run locally by transformers, and hivekeeper's per-hop
breakdown of one-token steps: the client's whole hop, the server's compute, and the overhead
between them (what the wire, the codecs and the server's queueing add); and the servers'
compute alone for the prompt and for a token, with the ratios to Petals it would allow if
nothing else took any time (both systems run the same blocks on the same cores, so the compute
is a floor neither can go under).

Anchors: Petals 2.2 itself, measured here; and the per-hop overhead of a call through p2pd,
3.9 ms for a one-token step on loopback (2.7 ms of it the RPC through p2pd).

Petals runs in its own venv (.petals-venv/, ignored by git), made on first use: torch 2.13.0
first, then petals==2.2.0.post1 pinned with it. Petals pins hivemind==1.1.10.post2, which has no
wheel: its sdist downloads p2pd v0.3.18 from GitHub while it builds, which this machine cannot
reach. The venv builds that sdist with the download step left out and the p2pd that
hivekeeper's hivemind 1.1.12 wheel ships in its place (both pass p2pd the same flags and speak
the same p2pd.proto). hivemind 1.1.10 imports the `multiaddr` package (1.1.12 carries its own
copy), whose newer releases encode the unix-socket addresses of stream handlers differently:
p2pd then cannot open the streams Petals' inference runs on (unary calls still work), so the
venv pins multiaddr==0.0.9, the release hivemind 1.1.10 names as its minimum. numpy<2 for
transformers 4.33. bench/petals_worker.py runs Petals' side (two shims there: see its docstring).

    .venv/bin/python bench/bench_petals.py [--rounds 5] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench_block_inference import hop_breakdown, start_servers, stop

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".petals-venv"
WORKER = Path(__file__).resolve().parent / "petals_worker.py"
TORCH, PETALS, HIVEMIND = "torch==2.13.0", "petals==2.2.0.post1", "hivemind==1.1.10.post2"
PREFIX = "hk-bench-llama"  # Petals' DHT prefix for the model
ANSWER = "@@petals@@ "
CONFIGS = [("1 server", ["0:8"]), ("2 servers", ["0:4", "4:8"])]
SYSTEMS = ("petals", "hivekeeper", "hivekeeper via p2pd")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# --- Petals' venv ---------------------------------------------------------------------------

def petals_python() -> Path:
    """.petals-venv's Python with Petals installed (made on first use)."""
    python = VENV / "bin" / "python"
    check = [str(python), "-c", "import importlib.metadata as m; "
             "assert (m.version('petals'), m.version('multiaddr')) == ('2.2.0.post1', '0.0.9')"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"making {VENV} (Petals 2.2 and its pins; once)", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    # torch first, from pip's cache: pinned again below so that nothing pulls another torch
    subprocess.run(pip + [TORCH, "setuptools>=77,<81", "wheel", "grpcio-tools"], check=True)
    wheels = VENV / "wheels"
    wheels.mkdir(exist_ok=True)
    _build_hivemind_wheel(python, wheels)
    subprocess.run(pip + ["--find-links", str(wheels), TORCH, PETALS, "numpy<2", "multiaddr==0.0.9"], check=True)
    subprocess.run(check, check=True)
    return python


def _build_hivemind_wheel(python: Path, wheels: Path) -> None:
    """hivemind 1.1.10.post2 from its sdist, with the p2pd of this venv's hivemind wheel
    instead of the one its setup.py would download."""
    import hivemind

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
                        "--no-binary", "hivemind", HIVEMIND, "-d", str(tmp)], check=True)
        (sdist,) = tmp.glob("hivemind-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        source = tmp / sdist.name.removesuffix(".tar.gz")
        setup = source / "setup.py"
        text = setup.read_text()
        download = "            download_p2p_daemon()\n"
        if text.count(download) != 1:
            raise RuntimeError(f"{HIVEMIND}: setup.py is not the one this bench knows how to build")
        setup.write_text(text.replace(download, "            pass  # p2pd is in place already\n"))
        p2pd = source / "hivemind" / "hivemind_cli" / "p2pd"
        shutil.copy(Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd", p2pd)
        p2pd.chmod(0o755)
        subprocess.run([str(python), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(wheels), str(source)], check=True)


# --- the model --------------------------------------------------------------------------------

def build_checkpoint(folder: Path, args: argparse.Namespace) -> None:
    """One random-weight Llama, saved once: both systems read these files."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=8,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)


def manifest(tmp: Path, checkpoint: Path, threads: int, name: str) -> Path:
    import yaml

    document = yaml.safe_load((REPO / "examples/blockserver.yaml").read_text())
    document["metadata"]["name"] = name
    spec = document["spec"]
    spec["model"] = {"checkpoint": str(checkpoint)}
    spec["servers"].update(torchThreads=threads, cacheTokens=8192, maxSessionTokens=2048)
    spec["balancer"]["enabled"] = False
    spec["client"]["enabled"] = False
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


# --- Petals' processes ---------------------------------------------------------------------------

def petals_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **OFFLINE, **extra}


class PetalsClient:
    """Petals' client in Petals' venv, answering one JSON line per command."""

    def __init__(self, python: Path, checkpoint: Path, peers: list[str], log: Path):
        self.process = subprocess.Popen(
            [str(python), str(WORKER), "client", str(checkpoint), PREFIX, *peers], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, start_new_session=True,
            env=petals_env(OMP_NUM_THREADS="1"))
        self.read()

    def read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
        raise RuntimeError(f"Petals' client stopped answering (exit code {self.process.poll()})")

    def ask(self, **command: Any) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:  # it leaves its loop; Petals' threads may keep the process up: stop() ends it
            self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.process.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        stop([self.process])


def petals_bootstrap(python: Path, tmp: Path) -> tuple[subprocess.Popen, list[str]]:
    """A DHT peer in Petals' venv for Petals' servers and client to meet at."""
    process = subprocess.Popen([str(python), str(WORKER), "dht"], stdout=subprocess.PIPE,
                               stderr=open(tmp / "petals-dht.log", "wb"), text=True, start_new_session=True,
                               env=petals_env())
    line = next((line for line in process.stdout if line.startswith(ANSWER)), None)
    if line is None:
        raise RuntimeError(f"Petals' DHT did not start; see {tmp / 'petals-dht.log'}")
    return process, json.loads(line[len(ANSWER):])["maddrs"]


def petals_servers(python: Path, checkpoint: Path, spans: list[str], peers: list[str], tmp: Path,
                   threads: int) -> list[subprocess.Popen]:
    common = ["--initial_peers", *peers, "--dht_prefix", PREFIX, "--device", "cpu", "--torch_dtype", "float32",
              "--quant_type", "none", "--throughput", "1.0", "--skip_reachability_check", "--no_auto_relay",
              "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--inference_max_length", "2048"]
    return [subprocess.Popen([str(python), str(WORKER), "server", str(checkpoint), "--block_indices", span,
                              "--public_name", f"petals-{i}", *common],
                             stdout=open(tmp / f"petals-server-{i}.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True, env=petals_env(OMP_NUM_THREADS=str(threads)))
            for i, span in enumerate(spans)]


# --- measuring ---------------------------------------------------------------------------------

def hivekeeper_generate(model, prompt, new_tokens: int) -> dict:
    marks: dict[int, float] = {}
    began = time.perf_counter()
    tokens = model.generate(prompt, new_tokens, on_token=lambda count, _: marks.setdefault(count, time.perf_counter()))
    ended = time.perf_counter()
    return {"tokens": tokens[0].tolist(), "ttft": marks[1] - began, "seconds": ended - began,
            "decode_seconds": ended - marks[1]}


def summarize(runs: list[dict], new_tokens: int) -> dict:
    rates = [(new_tokens - 1) / r["decode_seconds"] for r in runs]
    return {"decodeTokensPerSecond": round(statistics.median(rates), 2),
            "ttftMs": round(1000 * statistics.median(r["ttft"] for r in runs), 1),
            "decodeTokensPerSecondEach": [round(rate, 2) for rate in rates],
            "ttftMsEach": [round(1000 * r["ttft"], 1) for r in runs]}


def compute_floor(log: list[dict], petals: dict) -> dict:
    """The servers' compute alone, summed over the chain's spans (medians per span): for the
    prompt's prefill and for a one-token step; and the ratios to Petals they would give if
    nothing else (wire, codecs, the client's head) took any time."""
    def per_chain(steps: list[dict]) -> float:
        spans: dict[tuple[int, int], list[float]] = {}
        for e in steps:
            spans.setdefault((e["start"], e["end"]), []).append(e["compute_ms"])
        return sum(statistics.median(times) for times in spans.values())

    inference = [e for e in log if e["kind"] == "inference" and "compute_ms" in e]
    prefill = per_chain([e for e in inference if e["tokens"] > 1])
    step = per_chain([e for e in inference if e["tokens"] == 1])
    return {"prefillComputeMs": round(prefill, 2), "stepComputeMs": round(step, 2),
            "ttftFloorVsPetals": round(prefill / petals["ttftMs"], 2),
            "decodeCeilingVsPetals": round(1000 / step / petals["decodeTokensPerSecond"], 2)}


def server_threads(asked: int | None, servers: int) -> int:
    """Each server's torch threads: as asked, or the cores it would be given if the machine's were
    shared among the servers as CPU limits share them (2 servers with 2 threads each on 2 cores
    spin against each other: each one's OpenMP workers keep polling while the other computes)."""
    return asked or max(1, (os.cpu_count() or 1) // servers)


def run_config(name: str, spans: list[str], python: Path, checkpoint: Path, tmp: Path, args: argparse.Namespace,
               prompt, reference: list[int]) -> dict[str, Any]:
    """Both systems' servers for `spans`, three clients, `args.rounds` alternating rounds."""
    import hivemind

    from hivekeeper.blocks import protocol
    from hivekeeper.blocks.client import RemoteCausalLM, RemoteSequence
    from hivekeeper.spec import load_manifest

    print(f"{name}: starting servers", flush=True)
    run_id = f"bench-petals-{len(spans)}"
    threads = server_threads(args.threads, len(spans))
    path = manifest(tmp, checkpoint, threads, run_id)
    processes: list[subprocess.Popen] = []
    petals_client = dht = client_dht = None
    sequences: list = []
    try:
        bootstrap, petals_peers = petals_bootstrap(python, tmp)
        processes.append(bootstrap)
        processes += petals_servers(python, checkpoint, spans, petals_peers, tmp, threads)
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peers = [str(a) for a in dht.get_visible_maddrs()]
        processes += start_servers(path, spans, peers, tmp)
        deadline = time.monotonic() + 300
        while len([s for s in protocol.read_servers(dht, run_id) if s.state == protocol.ONLINE]) < len(spans):
            exited = [p.args[2:4] for p in processes if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: servers did not come up (exited: {exited or 'none'}); logs in {tmp}")
            time.sleep(0.5)
        petals_client = PetalsClient(python, checkpoint, petals_peers, tmp / "petals-client.log")
        if not petals_client.ask(cmd="wait", blocks=8, timeout=300).get("online"):
            raise RuntimeError(f"{name}: Petals' servers did not come up; see {tmp}")
        client_dht = hivemind.DHT(initial_peers=peers, client_mode=True, start=True)
        model_spec = load_manifest(path).spec.model
        clients: dict[str, Callable[[], dict]] = {
            "petals": lambda: petals_client.ask(cmd="generate", prompt=prompt[0].tolist(), new_tokens=args.new_tokens)}
        for system, direct in (("hivekeeper", True), ("hivekeeper via p2pd", False)):
            sequence = RemoteSequence(client_dht, run_id, 8, args.hidden, direct=direct)
            sequences.append(sequence)
            model = RemoteCausalLM(model_spec, sequence)
            clients[system] = lambda model=model: hivekeeper_generate(model, prompt, args.new_tokens)
        for system in SYSTEMS:  # warm-up: connections, routes, first sessions
            clients[system]()
        for sequence in sequences:
            sequence.hop_log = []
        runs: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
        for round_ in range(args.rounds):
            for system in SYSTEMS[round_ % 3:] + SYSTEMS[:round_ % 3]:
                runs[system].append(clients[system]())
            print(f"{name}: round {round_ + 1}/{args.rounds}: " + ", ".join(
                f"{s} {(args.new_tokens - 1) / runs[s][-1]['decode_seconds']:.1f} tok/s, "
                f"TTFT {1000 * runs[s][-1]['ttft']:.0f} ms" for s in SYSTEMS), flush=True)
    finally:
        for sequence in sequences:
            sequence.close()
        if petals_client is not None:
            petals_client.close()
        if client_dht is not None:
            client_dht.shutdown()
        stop(processes)
        if dht is not None:
            dht.shutdown()
    config: dict[str, Any] = {"spans": spans, "serverThreads": threads}
    for system in SYSTEMS:
        config[system] = {**summarize(runs[system], args.new_tokens),
                          "tokensEqualLocal": all(r["tokens"] == reference for r in runs[system])}
    first = runs["petals"][0]["tokens"]
    config["tokensEqualAcrossSystems"] = all(r["tokens"] == first for s in SYSTEMS for r in runs[s])
    for system, sequence in zip(SYSTEMS[1:], sequences):
        config[system]["hops"] = hop_breakdown(sequence.hop_log)
        config[system].update(compute_floor(sequence.hop_log, config["petals"]))
        config[system]["decodeVsPetals"] = round(config[system]["decodeTokensPerSecond"]
                                                 / config["petals"]["decodeTokensPerSecond"], 2)
        config[system]["ttftVsPetals"] = round(config[system]["ttftMs"] / config["petals"]["ttftMs"], 2)
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds: each system generates once a round")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per server, both systems (default: the machine's cores shared among the servers)")
    parser.add_argument("--only", choices=[name for name, _ in CONFIGS], default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops every server

    python = petals_python()
    import torch

    from bench_results import write_results
    from hivekeeper.blocks.checkpoint import load_model
    from hivekeeper.blocks.client import local_generate
    from hivekeeper.spec import load_manifest

    torch.set_num_threads(1)  # the clients run embeddings and head only (Petals' client likewise)
    prompt = torch.tensor([[(17 * i + 3) % args.vocab for i in range(args.prompt_tokens)]])
    results: dict[str, Any] = {"model": {"layers": 8, "hidden": args.hidden, "intermediate": args.intermediate,
                                         "heads": args.heads, "vocab": args.vocab, "dtype": "float32"},
                               "promptTokens": args.prompt_tokens, "newTokens": args.new_tokens,
                               "rounds": args.rounds,
                               "petals": "petals==2.2.0.post1, hivemind 1.1.10.post2, transformers 4.33.3, torch 2.13.0",
                               "configs": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-petals-"))  # logs stay where a run fails
    checkpoint = tmp / "llama-8"
    build_checkpoint(checkpoint, args)
    reference = local_generate(load_model(load_manifest(manifest(tmp, checkpoint, 1, "local")).spec.model),
                               prompt, args.new_tokens)[0].tolist()
    for name, spans in CONFIGS:
        if args.only in (None, name):
            results["configs"][name] = run_config(name, spans, python, checkpoint, tmp, args, prompt, reference)
    shutil.rmtree(tmp, ignore_errors=True)
    report(results)
    write_results("petals_side_by_side", anchor="Petals 2.2 (petals==2.2.0.post1) measured here side by side; "
                                                "per-hop overhead through p2pd 3.9 ms (issue 21)", **results)


def report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    model = results["model"]
    table = Table(title=f"Petals 2.2 vs hivekeeper: 8-layer Llama (hidden {model['hidden']}, float32, CPU), "
                        f"{results['promptTokens']}-token prompt, {results['newTokens']} greedy tokens, "
                        f"medians of {results['rounds']} alternating rounds")
    for column in ("servers", "system", "decode tok/s", "vs Petals", "compute-only ceiling", "TTFT ms", "vs Petals",
                   "compute-only floor", "hop ms", "compute ms", "overhead ms", "tokens = local"):
        table.add_column(column, justify="left" if column in ("servers", "system") else "right")
    for name, config in results["configs"].items():
        for system in SYSTEMS:
            r = config[system]
            hops = r.get("hops") or {}
            threads = config.get("serverThreads")
            table.add_row(f"{name}, {threads} thread{'s' if threads != 1 else ''}{' each' if len(config['spans']) > 1 else ''}" if threads else name, system, f"{r['decodeTokensPerSecond']:.1f}",
                          f"{r['decodeVsPetals']:.2f}x" if "decodeVsPetals" in r else "",
                          f"{r['decodeCeilingVsPetals']:.2f}x" if "decodeCeilingVsPetals" in r else "",
                          f"{r['ttftMs']:.0f}", f"{r['ttftVsPetals']:.2f}x" if "ttftVsPetals" in r else "",
                          f"{r['ttftFloorVsPetals']:.2f}x" if "ttftFloorVsPetals" in r else "",
                          f"{hops['hopMs']:.2f}" if hops else "", f"{hops['computeMs']:.2f}" if hops else "",
                          f"{hops['overheadMs']:.2f}" if hops else "", "yes" if r["tokensEqualLocal"] else "NO")
    Console(width=220).print(table)
    print("compute-only ceiling / floor: the ratio to Petals if the servers' compute were all a token or the "
          "prompt cost (no wire, no codecs, no client work)")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
