import zlib

import torch


def param_generator(seed: int, name: str, device: torch.device | str) -> torch.Generator:
    """One RNG stream per parameter name, so a parameter's initial value depends only on the
    seed and its name: not on creation order, nor on which other parameters a rank holds."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
