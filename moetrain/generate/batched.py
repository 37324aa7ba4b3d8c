"""Decoding a batch of prompts with a KV cache (moetrain/generate/kv_cache.py).

The prompts are left-padded to the longest: every row's last prompt token is in the last
column, so each step feeds one token per row. Each row's positions start at 0 at its first
real token (RoPE sees what it would see alone) and its padding is a document of its own,
never seen by a real token. Routing is per token, so padding costs compute, not answers.
The prompt is run through the model in chunks that bound its logits' memory; then one
token a row a step, against the cache. A row leaves the batch (its cache rows dropped) when
it stops; the batch ends when every row has stopped or has --max-new-tokens tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moetrain.generate.decode import GREEDY, Sampling, pick_rows
from moetrain.generate.kv_cache import cached_attention
from moetrain.models.common.plan import ParallelPlan

# The most logits one prefill chunk may produce (elements: 256 MiB in fp32): a long prompt
# of a large vocabulary runs in several chunks rather than as one [B, S, V] tensor.
PREFILL_LOGITS = 2**26


@dataclass
class Answer:
    ids: list[int] = field(default_factory=list)  # the new tokens
    stopped: bool = False  # a stop token ended them (it is the last id)


def left_padded(
    prompts: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, document_ids [B, longest]: the prompts right-aligned; the
    padding (id 0, position 0) is document 0, each prompt's tokens document 1."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    positions, documents = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        pad = longest - len(prompt)
        ids[row, pad:] = torch.tensor(prompt, dtype=torch.int64)
        positions[row, pad:] = torch.arange(len(prompt))
        documents[row, pad:] = 1
    return ids.to(device), positions.to(device), documents.to(device)


def _prefill(
    model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor
) -> torch.Tensor:
    """Run the prompts [B, S] into the cache; the last column's logits [B, V]."""
    rows, length = ids.shape
    chunk = max(1, PREFILL_LOGITS // (rows * model.args.vocab_size))
    for begin in range(0, length, chunk):
        part = slice(begin, begin + chunk)
        logits = model(ids[:, part], positions[:, part], documents[:, part]).logits[:, -1]
    return logits


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    plan: ParallelPlan,
    prompts: list[list[int]],
    stop: set[int],
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
) -> list[Answer]:
    """Each prompt's answer, in the prompts' order: its new tokens, up to and including a
    stop token or `max_new_tokens` of them. `plan`: the model's parallel plan (its
    attention cores are cached)."""
    device = next(model.parameters()).device
    ids, positions, documents = left_padded(prompts, device)
    generators = [sampling.generator(device) for _ in prompts]
    answers = [Answer() for _ in prompts]
    active = list(range(len(prompts)))  # the prompt each batch row holds
    with cached_attention(model, plan) as cache:
        cache.start(ids.shape[1] + max_new_tokens - 1)  # the last token is never fed back
        logits = _prefill(model, ids, positions, documents)
        for step in range(max_new_tokens):
            tokens = pick_rows(logits, sampling, [generators[i] for i in active])
            going = []
            for row, (i, token) in enumerate(zip(active, tokens)):
                answers[i].ids.append(token)
                answers[i].stopped = token in stop
                if not answers[i].stopped:
                    going.append(row)
            if not going or step + 1 == max_new_tokens:
                break
            if len(going) < len(active):  # finished rows leave the batch
                kept = torch.tensor(going, device=device)
                cache.keep(kept)
                positions = positions.index_select(0, kept)
                active = [active[row] for row in going]
            new = torch.tensor([[answers[i].ids[-1]] for i in active], device=device)
            positions = positions[:, -1:] + 1
            logits = model(new, positions, torch.ones_like(new)).logits[:, -1]
    return answers
