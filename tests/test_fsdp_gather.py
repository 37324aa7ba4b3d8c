"""`parallel.fsdp_gather=step`: parameters gathered once per step and gradients reduced
once, against the single-process reference (tests/parity.py) and against the default path,
with the bytes each moves counted from the collectives FSDP really calls."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_distributed
from tests.parity import (
    TINY,
    assert_same_training,
    build_trainer,
    reference_run,
    stepped_records,
)

c10d = torch.ops.c10d


class CollectiveBytes(TorchDispatchMode):
    """The bytes of each all-gather's output and each reduce-scatter's input, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers: list[int] = []
        self.scatters: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is c10d._allgather_base_.default:
            self.gathers.append(args[0].numel() * args[0].element_size())
        elif func is c10d._reduce_scatter_base_.default:
            self.scatters.append(args[1].numel() * args[1].element_size())
        return func(*args, **(kwargs or {}))


def gather_worker(rank: int, world: int, argv: list[str], out: str) -> None:
    result = {}
    for mode in ("micro_batch", "step"):
        _, trainer = build_trainer([*argv, f"--parallel.fsdp_gather={mode}"], world)
        counted = CollectiveBytes()
        steps = stepped_records(trainer, 3)
        records = [next(steps)]
        with counted:  # the second step: the collectives of one steady step
            records.append(next(steps))
        records.append(next(steps))
        for r in records:  # the buffers at the end: this model has none that move
            r["buffers"] = {n: b.clone() for n, b in trainer.model.named_buffers()}
        result[mode] = {
            "records": records,
            "gathers": counted.gathers,
            "scatters": counted.scatters,
        }
    if rank == 0:
        torch.save(result, out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout,dp",
    [(2, [], 2), (4, ["--parallel.cp=2", "--parallel.ep=2"], 2)],
    ids=["fsdp2", "cp2_ep2"],
)
def test_gathering_once_per_step_trains_the_same_and_moves_a_micro_batchs_bytes(
    world, layout, dp, tmp_path
):
    argv = [*TINY, *layout]
    run_distributed(gather_worker, world, argv, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = reference_run(argv, dp_size=dp)
    for mode in ("micro_batch", "step"):
        assert_same_training(out[mode]["records"], ref)
    per_step, once = out["micro_batch"], out["step"]
    rounds = 2  # micro-batches per rank and step: 8 samples, micro-batch 2, 2 data ranks
    # Once per step: each unit all-gathered once (the root first, in forward) and
    # reduce-scattered once; per micro-batch: every round again, and the units resharded
    # after forward (all but the root) gathered again in backward.
    root, *rest = once["gathers"]
    expected = Counter({root: rounds})
    for size in rest:
        expected[size] += 2 * rounds
    assert Counter(per_step["gathers"]) == expected
    assert Counter(per_step["scatters"]) == Counter(
        {s: n * rounds for s, n in Counter(once["scatters"]).items()}
    )
    print(
        f"bytes per step, rank 0: all-gather {sum(per_step['gathers'])} -> {sum(once['gathers'])}, "
        f"reduce-scatter {sum(per_step['scatters'])} -> {sum(once['scatters'])}"
    )
