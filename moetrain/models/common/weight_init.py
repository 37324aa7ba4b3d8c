"""Layout-independent initialisation, one bounded tile at a time.

A parameter's initial value is a function of (seed, name, global shape) only. The tensor is
cut into fixed tiles (`init_tiles`: runs of rows along the leading dims, at most
`TILE_ELEMS` elements each, a function of the global shape alone), and tile k draws from
its own stream, keyed by (seed, name, k). So a rank can fill just the tiles that meet its
shard, holding at most one tile beyond its shard at a time, and still get the same global
values as one process filling the whole tensor: DeepSeek-V3's expert stack [256, 4096,
7168] is 28 GiB in fp32, a tile 64 MiB.
"""

import math
import zlib

import torch

from moetrain.models.common.norm import RMSNorm

# 16M elements: 64 MiB in fp32. A constant, not a knob: the tiling decides the values.
TILE_ELEMS = 1 << 24
Index = tuple[slice, ...]


def param_generator(seed: int, name: str, device: torch.device | str) -> torch.Generator:
    """One RNG stream per name (a parameter's, or a tile's: `name[k]`), so a value depends
    only on the seed and the name: not on creation order, nor on what else a rank holds."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def init_tiles(shape: tuple[int, ...], tile_elems: int = TILE_ELEMS) -> list[Index]:
    """The tiles of a tensor of `shape`, in order: runs of whole rows of dim 0 when a row
    fits in `tile_elems`, else each row of dim 0 tiled the same way on the remaining dims."""
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    if inner <= tile_elems:
        rows = max(1, tile_elems // max(inner, 1))
        rest = tuple(slice(0, n) for n in shape[1:])
        return [(slice(a, min(a + rows, shape[0])), *rest) for a in range(0, shape[0], rows)]
    sub = init_tiles(shape[1:], tile_elems)
    return [(slice(i, i + 1), *t) for i in range(shape[0]) for t in sub]


def tile_generator(
    seed: int, name: str, k: int, num_tiles: int, device: torch.device | str
) -> torch.Generator:
    # A tensor of one tile keeps the plain per-name stream.
    return param_generator(seed, name if num_tiles == 1 else f"{name}[{k}]", device)


def normal_init_(
    model: torch.nn.Module,
    name: str,
    tensor: torch.Tensor,
    std: float,
    generator: torch.Generator | None,
    zero_leaves: tuple[str, ...] = ("bias",),
    embedding_std: float = 0.0,
) -> None:
    """Hugging Face's init for decoder LMs: RMSNorm weights 1, the `zero_leaves` (biases,
    routing state) 0, every other weight N(0, std); token embeddings N(0, embedding_std)
    when it is set (the models' `embedding_init_std`). Elementwise, so it fills a tile as
    it would the whole tensor."""
    owner = model.get_submodule(name.rpartition(".")[0])
    if isinstance(owner, RMSNorm):
        tensor.fill_(1.0)
    elif name.rpartition(".")[2] in zero_leaves:
        tensor.zero_()
    elif embedding_std > 0 and isinstance(owner, torch.nn.Embedding):
        tensor.normal_(0.0, embedding_std, generator=generator)
    else:
        tensor.normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_all_(model: torch.nn.Module, seed: int, tile_elems: int = TILE_ELEMS) -> None:
    """Every (unsharded) parameter and buffer of `model`, tile by tile through its
    `reset_parameter`: the values the trainer gives the shards on any layout."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tiles = init_tiles(tuple(tensor.shape), tile_elems)
        for k, tile in enumerate(tiles):
            gen = tile_generator(seed, name, k, len(tiles), tensor.device)
            model.reset_parameter(name, tensor[tile], gen)
