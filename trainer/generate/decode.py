"""The decoding loop: one full forward over the whole sequence per new token.

NOTE: no KV cache. Each step runs the model on the prompt and every token generated so far
and keeps the last position's logits: O(n^2) work for n tokens instead of O(n). This is a
check tool (what does the trained model say to a few prompts, does it stop where it should),
and the full forward is exactly the function training computed (the models' contract,
models/spec.py: input_ids and position_ids in, logits out), so no cache code can make it
disagree with the model that was trained. A few hundred tokens take seconds on small models.
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


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
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


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    stop: set[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
) -> tuple[list[int], bool]:
    """(the new token ids, whether a stop token ended them; it is the last id then)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        positions = torch.arange(ids.shape[1], device=device)[None]
        logits = model(ids, positions).logits[0, -1]
        token = _pick(logits, sampling, generator)
        new.append(token)
        if token in stop:
            return new, True
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return new, False
