"""Qwen3-MoE with context parallelism (ring attention) against one plain process."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import TINY, assert_same_training, layout_worker, reference_run


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout,dp_size",
    [
        (2, ["--parallel.cp=2"], 1),
        (4, ["--parallel.cp=2", "--parallel.ep=2"], 2),  # EP borrows the cp ranks
        (
            4,
            [
                "--parallel.cp=2",
                "--parallel.cp_layout=contiguous",
                "--moe.aux_loss_mode=global_batch",
            ],
            2,
        ),
    ],
    ids=["cp2", "cp2_ep2", "cp2_contiguous_global_aux"],
)
def test_layout_matches_single_process(world, layout, dp_size, tmp_path):
    argv = TINY + layout
    run_distributed(layout_worker, world, argv, str(tmp_path / "out.pt"), None)
    ours = torch.load(tmp_path / "out.pt")["records"]
    assert_same_training(ours, reference_run(argv, dp_size=dp_size))
