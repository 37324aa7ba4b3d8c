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


class FlatDivisions(TorchDispatchMode):
    """Divisions of a flat (1-D) fp32 buffer of over 1,024 elements by a Python number: how
    FSDP applies a gradient divide factor to a unit's packed gradients (the model's own
    1-D divisions, RoPE's frequencies, are of a few elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor):
            t, other = args[0], args[1]
            flat = t.ndim == 1 and t.numel() > 1024 and t.dtype == torch.float32
            self.count += flat and isinstance(other, (int, float))
        return func(*args, **(kwargs or {}))


def test_one_rank_fsdp_reduces_gradients_without_dividing_them():
    """On a mesh of one rank FSDP copies each unit's gradients out through `grads / factor`
    whenever a divide factor is set: a pass over every fp32 gradient for nothing. None is
    set there; the control sets it back and the detector sees one division per unit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _, trainer = build_trainer(TINY, 1)
        units = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        counts = []
        for control in (False, True):
            if control:
                for unit in units:
                    unit.set_gradient_divide_factor(1.0)
            scalings = FlatDivisions()
            with scalings:
                trainer.steps.train_step(trainer.next_micro_batches())
            counts.append(scalings.count)
        # Each unit reduced once a step: on one rank `auto` gathers and reduces once per
        # step (4 micro-batches here).
        assert counts == [0, len(units)], counts
    finally:
        dist.destroy_process_group()


def test_one_rank_auto_accumulates_as_the_single_process_reference_does():
    """`auto` on one rank gathers once per step: 4 micro-batches accumulated into gradients
    that FSDP reduces once give the reference's losses, gradients and weights (issue 64)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _, trainer = build_trainer(TINY, 1)
        assert trainer.dims.fsdp_gather(trainer.cfg.parallel.fsdp_gather) == "step"
        records = []
        for record in stepped_records(trainer, 3):
            record["buffers"] = {n: b.clone() for n, b in trainer.model.named_buffers()}
            records.append(record)
    finally:
        dist.destroy_process_group()
    assert_same_training(records, reference_run(TINY, dp_size=1))


def test_auto_gathers_once_per_step_where_fsdp_has_one_rank_only():
    from moetrain.parallelisms.dims import ParallelDims

    one = ParallelDims.resolve(1, -1, 1, 1, 1)
    assert one.fsdp_gather("auto") == "step"
    assert one.fsdp_gather("micro_batch") == "micro_batch"  # what is set is what runs
    for dims in (
        ParallelDims.resolve(1, -1, 1, 1, 2),  # FSDP 2
        ParallelDims.resolve(2, 1, 1, 1, 2),  # replicas
        ParallelDims.resolve(1, 1, 2, 1, 2),  # CP 2
        ParallelDims.resolve(1, 1, 1, 1, 2, pp=2),  # stages gather once already
    ):
        assert dims.fsdp_gather("auto") == "micro_batch", dims
