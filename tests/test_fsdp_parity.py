"""FSDP / HSDP on real gloo ranks against one plain process on the same global batch."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import TINY, assert_same_training, layout_worker, reference_run


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout",
    [
        (2, []),  # FSDP over 2 ranks, grad accumulation 2
        (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]),  # HSDP, no accumulation
    ],
    ids=["fsdp2", "hsdp2x2"],
)
def test_layout_matches_single_process(world, layout, tmp_path):
    argv = TINY + layout
    run_distributed(layout_worker, world, argv, str(tmp_path / "out.pt"), None)
    ours = torch.load(tmp_path / "out.pt")["records"]
    assert_same_training(ours, reference_run(argv, dp_size=world))
