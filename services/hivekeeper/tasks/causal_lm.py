"""A small causal language model trained on text every Python install carries: the standard
library's own source files. Bytes are tokens (vocabulary 256), so no tokenizer is downloaded.
The model is a randomly initialized Hugging Face Llama or GPT-2 config; held-out perplexity
(per byte) is the metric, and the checkpoint is a `save_pretrained` folder a BlockServer can serve."""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import torch

from hivekeeper.tasks.base import Task
from hivekeeper.tasks.options import CausalLMOptions

VOCAB_SIZE = 256


def stdlib_source_files(limit: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    return files[:limit]


def build_config(options: CausalLMOptions):
    import transformers

    if options.architecture == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=options.hidden_size,
            intermediate_size=4 * options.hidden_size,
            num_hidden_layers=options.num_layers,
            num_attention_heads=options.num_heads,
            num_key_value_heads=options.num_heads,
            max_position_embeddings=options.sequence_length,
            tie_word_embeddings=False,
        )
    return transformers.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=options.hidden_size,
        n_layer=options.num_layers,
        n_head=options.num_heads,
        n_positions=options.sequence_length,
    )


class CausalLMTask(Task):
    options_model = CausalLMOptions

    def __init__(self, options=None, seed: int = 0):
        super().__init__(options, seed)
        train, held_out = bytearray(), bytearray()
        for path in stdlib_source_files(self.options.max_files):
            data = path.read_bytes() + b"\n"
            # Split by file, by a hash of its name: stable across machines and peers.
            bucket = int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % 10_000 / 10_000
            (held_out if bucket < self.options.held_out_fraction else train).extend(data)
        if not held_out:  # a tiny max_files can leave the held-out set empty
            held_out, train = train[-len(train) // 10 :], train[: -len(train) // 10]
        n = self.options.sequence_length
        self.train_tokens = torch.tensor(list(train), dtype=torch.long)
        self.eval_tokens = torch.tensor(list(held_out), dtype=torch.long)
        self._num_train = (len(self.train_tokens) - 1) // n

    @property
    def train_size(self) -> int:
        return self._num_train

    def build_model(self) -> torch.nn.Module:
        import transformers

        torch.manual_seed(self.seed)
        return transformers.AutoModelForCausalLM.from_config(build_config(self.options))

    def train_batch(self, indices: list[int]) -> torch.Tensor:
        n = self.options.sequence_length
        return torch.stack([self.train_tokens[i * n : i * n + n] for i in indices])

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        n = self.options.sequence_length
        count = min(self.options.eval_sequences, (len(self.eval_tokens) - 1) // n)
        device = next(model.parameters()).device
        batch = torch.stack([self.eval_tokens[i * n : i * n + n] for i in range(count)]).to(device)
        was_training = model.training
        model.eval()
        loss = model(input_ids=batch, labels=batch).loss.item()
        model.train(was_training)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
