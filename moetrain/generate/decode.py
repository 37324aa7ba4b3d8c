"""Picking tokens, and the reference decoder: one full forward over the whole sequence per
new token (`generate_uncached`).

The reference runs the model on the prompt and every token generated so far and keeps the
last position's logits: O(n^2) work for n tokens, exactly the function training computed
(the models' contract, moetrain/models/spec.py: input_ids and position_ids in, logits out). The
command decodes with a KV cache (moetrain/generate/batched.py); the tests and
benchmarks/generate_speed.py hold it to this decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (the most likely token, the lowest id among equals, as
    `torch.argmax` and transformers' greedy decoding pick it)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def generator(self, device: torch.device) -> torch.Generator:
        """The draws of one prompt: each has its own, seeded with `seed`, so that an answer
        does not depend on the prompts decoded beside it."""
        return torch.Generator(device=device).manual_seed(self.seed)


GREEDY = Sampling()


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the last position's logits [V]."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:  # nucleus: the most likely tokens whose mass reaches top_p
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the likelier ones
        sorted_probs[before >= sampling.top_p] = 0.0  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def pick_rows(
    logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]
) -> list[int]:
    """The next token of each row of logits [B, V], row i drawing from generators[i]."""
    if sampling.temperature == 0:
        return torch.argmax(logits, dim=-1).tolist()
    return [pick(row, sampling, g) for row, g in zip(logits, generators, strict=True)]


@torch.no_grad()
def generate_uncached(
    model: nn.Module,
    prompt: list[int],
    stop: set[int],
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
) -> tuple[list[int], bool]:
    """(the new token ids, whether a stop token ended them; it is the last id then)."""
    device = next(model.parameters()).device
    generator = sampling.generator(device)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        positions = torch.arange(ids.shape[1], device=device)[None]
        logits = model(ids, positions).logits[0, -1]
        token = pick(logits, sampling, generator)
        new.append(token)
        if token in stop:
            return new, True
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return new, False
