"""Shard-sized initialisation: the same global weights on every layout, generated tile by
tile, with no allocation larger than one tile (measured by recording every allocating op)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from models import get_model_spec
from models.common.init import init_all_, init_tiles
from parallelisms.dims import ParallelDims
from parallelisms.init import init_weights_global
from tests.distributed import run_distributed
from tests.parity import TINY, TINY_DSV3
from trainer.config import load_config

TILE = 48  # elements: far below every weight matrix of the tiny models, so all are tiled
ALLOCATING = {"empty", "empty_strided", "zeros", "ones", "full", "clone", "_to_copy", "cat"}


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any allocating op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ALLOCATING and isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel())
        return out


@pytest.mark.parametrize(
    "shape,tile",
    [((10,), 3), ((7, 5), 12), ((3, 4, 5), 7), ((3, 4, 5), 1), ((2, 3), 100), ((), 4)],
)
def test_tiles_cover_every_element_once_and_stay_within_the_bound(shape, tile):
    hits = torch.zeros(shape, dtype=torch.int64)
    for box in init_tiles(shape, tile):
        hits[box] += 1
        assert hits[box].numel() <= max(tile, 1)
    assert torch.all(hits == 1)


def _worker(rank, world, argv, tile, out_path):
    from trainer.loop.trainer import Trainer

    cfg = load_config(argv)
    p = cfg.parallel
    trainer = Trainer(cfg, ParallelDims.of(p, world))
    for param in trainer.model.parameters():  # forget the default init
        (param.to_local() if isinstance(param, DTensor) else param).data.fill_(float("nan"))
    with LargestAllocation() as probe:
        init_weights_global(trainer.model, cfg.train.seed, tile_elems=tile)
    full = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for n, t in [*trainer.model.named_parameters(), *trainer.model.named_buffers()]
    }
    if rank == 0:
        torch.save({"full": full, "largest": probe.largest}, out_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv,world",
    [(TINY + ["--parallel.ep=2"], 4), (TINY_DSV3 + ["--parallel.dp_shard=2"], 2)],
    ids=["qwen3_ep2_efsdp2", "dsv3_fsdp2"],
)
def test_tiled_init_is_layout_independent_and_bounded(argv, world, tmp_path):
    run_distributed(_worker, world, argv, TILE, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    cfg = load_config(argv)
    reference = get_model_spec(cfg.model.name).build(cfg.model.args)
    init_all_(reference, cfg.train.seed, tile_elems=TILE)
    ref = dict([*reference.named_parameters(), *reference.named_buffers()])
    assert out["full"].keys() == ref.keys()
    for name, value in out["full"].items():
        assert torch.equal(value, ref[name]), name
    largest_param = max(t.numel() for t in ref.values())
    assert largest_param > 100 * TILE  # the bound is meaningful: weights are much larger
    assert 0 < out["largest"] <= TILE
