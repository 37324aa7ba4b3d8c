import zlib

import torch

from models.common.norm import RMSNorm


def param_generator(seed: int, name: str, device: torch.device | str) -> torch.Generator:
    """One RNG stream per parameter name, so a parameter's initial value depends only on the
    seed and its name: not on creation order, nor on which other parameters a rank holds."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def normal_init_(
    model: torch.nn.Module,
    name: str,
    tensor: torch.Tensor,
    std: float,
    generator: torch.Generator | None,
    zero_leaves: tuple[str, ...] = ("bias",),
) -> None:
    """Hugging Face's init for decoder LMs: RMSNorm weights 1, the `zero_leaves` (biases,
    routing state) 0, every other weight N(0, std)."""
    owner = model.get_submodule(name.rpartition(".")[0])
    if isinstance(owner, RMSNorm):
        tensor.fill_(1.0)
    elif name.rpartition(".")[2] in zero_leaves:
        tensor.zero_()
    else:
        tensor.normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_all_(model: torch.nn.Module, seed: int) -> None:
    """Every (unsharded) parameter and buffer of `model` through its `reset_parameter`, each
    from its own stream (`param_generator`): what the trainer does shard by shard."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        model.reset_parameter(name, tensor, param_generator(seed, name, tensor.device))
