"""Scripted client role: generates `client.newTokens` tokens from `client.prompt` through the
block servers (waiting for them to cover the model), optionally checks the tokens against the
same model run whole in this process, writes RUN_DIR/result.json and exits: the run is done."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from hivekeeper.blocks import protocol
from hivekeeper.blocks.checkpoint import load_config
from hivekeeper.blocks.client import InferenceSession, RemoteCausalLM, RemoteSequence, local_generate
from hivekeeper.blocks.role import load_block_context
from hivekeeper.spec.blockserver import BlockServerSpec

log = logging.getLogger("hivekeeper.blocks.client")


class Text:
    """Bytes are tokens for byte-level models (the tiny ones); a checkpoint's own tokenizer otherwise."""

    def __init__(self, spec: BlockServerSpec, vocab_size: int):
        self.tokenizer = None
        if spec.model.checkpoint and any(Path(spec.model.checkpoint).glob("tokenizer*")):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(spec.model.checkpoint, local_files_only=True)
        elif vocab_size < 256:
            raise SystemExit(f"model: vocabulary of {vocab_size} has no tokenizer and cannot hold bytes")

    def encode(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text)["input_ids"] if self.tokenizer else list(text.encode())
        return torch.tensor([ids], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer:
            return self.tokenizer.decode(ids)
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def run(args: argparse.Namespace) -> int:
    ctx = load_block_context("block-client", args)
    torch.set_num_threads(1)  # the client runs only embeddings and the head
    spec: BlockServerSpec = ctx.manifest.spec
    client = spec.client
    config = load_config(spec.model)
    text = Text(spec, int(config.vocab_size))
    ctx.start_endpoint()
    dht = ctx.make_dht(client_mode=True)
    ctx.endpoint.ready.set()
    sequence = RemoteSequence(dht, ctx.run_id, int(config.num_hidden_layers), int(config.hidden_size),
                              spec.compression, route_wait=300.0)
    prompt = text.encode(client.prompt)
    began, counted = [0.0], [0]

    def on_token(count: int, session: InferenceSession) -> None:
        if count == 1:
            began[0] = time.perf_counter()
        elapsed = time.perf_counter() - began[0]
        servers = [s for s in sequence.servers() if s.state == protocol.ONLINE]
        ctx.metrics.generated_tokens.inc()
        ctx.metrics.failovers.inc(sequence.failovers - counted[0])
        counted[0] = sequence.failovers
        ctx.status.update(globalStep=count, samplesPerSecond=(count - 1) / elapsed if elapsed > 0 else 0.0,
                          peersAlive={"block-server": len(servers)}, evalStep=None, evalMetrics={},
                          chain=[f"{h.start}:{h.end}@{h.peer_id[-8:]}" for h in session.chain],
                          failovers=sequence.failovers)

    ctx.status.update(globalStep=0, samplesPerSecond=0.0, peersAlive={}, evalStep=None, evalMetrics={})
    exit_code = 0
    try:
        model = RemoteCausalLM(spec.model, sequence)
        log.info("generating", extra={"fields": {"prompt": client.prompt, "new_tokens": client.new_tokens}})
        tokens = model.generate(prompt, client.new_tokens, do_sample=client.do_sample, temperature=client.temperature,
                                top_k=client.top_k, seed=client.seed, on_token=on_token)
        seconds = time.perf_counter() - began[0]
        new = tokens[0, prompt.shape[1]:].tolist()
        metrics = {"tokensPerSecond": round((len(new) - 1) / seconds, 3) if seconds > 0 else None,
                   "failovers": sequence.failovers}
        if client.verify_local:
            reference = local_generate(spec.model, prompt, client.new_tokens, do_sample=client.do_sample,
                                       temperature=client.temperature, top_k=client.top_k, seed=client.seed)
            metrics["matchesLocal"] = reference[0, prompt.shape[1]:].tolist() == new
        result = {"globalStep": len(new), "reason": f"generated {len(new)} tokens", "metrics": metrics,
                  "prompt": client.prompt, "text": text.decode(new), "tokens": new,
                  "chain": ctx.status.get("chain")}
        (Path(args.run_dir) / "result.json").write_text(json.dumps(result, indent=2))
        log.info("generated", extra={"fields": result})
    except Exception:
        log.exception("generation failed")
        exit_code = 1
    finally:
        sequence.close()
        dht.shutdown()
    return exit_code
