"""The planner's pipeline model (`moetrain.planner.pipeline_schedule`): torch's own orders of
actions, replayed, against the closed forms of the schedules' papers."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moetrain.parallelisms.dims import stage_rank, stages_per_rank
from moetrain.planner.pipeline_schedule import held_peak, schedule_order, simulate


@pytest.fixture
def fake_world():
    """The planner's setting: a fake process group (the schedules build their order on a
    group of it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def _uniform(schedule: str, pp: int, virtual: int, n: int, p2p: float = 0.0):
    """Stages of equal cost: a rank's stages together take 1 forward, 2 backward (input
    and weight halves 1 each) per micro-batch."""
    order = schedule_order(schedule, pp, virtual, n)
    stages = pp * stages_per_rank(schedule, virtual)
    rank_of = [stage_rank(s, pp, schedule) for s in range(stages)]
    unit = pp / stages
    durations = {"F": [unit] * stages, "B": [2 * unit] * stages}
    durations.update(I=[unit] * stages, W=[unit] * stages)
    span, busy = simulate(order, rank_of, durations, p2p)
    return order, span, busy


def test_1f1b_bubble_and_activations_follow_the_closed_forms(fake_world):
    for pp, n in ((2, 2), (4, 8), (4, 16)):
        order, span, busy = _uniform("1F1B", pp, 1, n)
        assert busy == [3.0 * n] * pp
        assert (span - busy[0]) / span == pytest.approx((pp - 1) / (n + pp - 1))
        # the first stage holds pp micro-batches, the last one
        held = [held_peak(order[r], [1.0] * pp) for r in range(pp)]
        assert held == [min(pp - r, n) for r in range(pp)]


def test_interleaving_divides_the_bubble_by_the_virtual_stages(fake_world):
    pp, v, n = 4, 2, 8
    _, span, busy = _uniform("Interleaved1F1B", pp, v, n)
    assert (span - busy[0]) / span == pytest.approx((pp - 1) / (v * n + pp - 1))


def test_zero_bubble_schedules_fill_most_of_it(fake_world):
    pp, n = 4, 16
    _, span, busy = _uniform("1F1B", pp, 1, n)
    one_f_one_b = span - busy[0]
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        order, span, busy = _uniform(schedule, pp, 2, n)
        assert busy == [3.0 * n] * pp
        assert span - busy[0] < one_f_one_b / 2, schedule
    # ZB-V holds 1F1B's first-stage activations on every rank: 2 pp half-size chunks
    order = schedule_order("ZBVZeroBubble", pp, 2, n)
    assert [held_peak(order[r], [1.0] * 2 * pp) for r in range(pp)] == [2.0 * pp] * pp


def test_a_send_between_ranks_delays_the_pipeline_by_its_hops(fake_world):
    """One micro-batch through 1F1B on 4 ranks crosses 3 boundaries forward and 3 back."""
    _, span, _ = _uniform("1F1B", 4, 1, 4)
    _, slower, _ = _uniform("1F1B", 4, 1, 4, p2p=0.5)
    assert slower > span
    _, one, _ = _uniform("1F1B", 4, 1, 1)
    _, one_sent, _ = _uniform("1F1B", 4, 1, 1, p2p=0.5)
    assert one_sent - one == pytest.approx(6 * 0.5)


def test_dualpipev_pairs_hide_each_others_all_to_all(fake_world):
    """With the expert all-to-all half of every forward and backward, DualPipeV's
    overlapped pairs run their two at once (moetrain/parallelisms/pipeline_overlap.py): each pair
    hides min(a2a_F, compute_B) + min(a2a_B, compute_F), and the busy time drops by
    that for every pair, nothing else."""
    pp, n = 4, 16
    order = schedule_order("DualPipeV", pp, 2, n)
    stages = 2 * pp
    rank_of = [stage_rank(s, pp, "DualPipeV") for s in range(stages)]
    unit = pp / stages
    durations = {"F": [unit] * stages, "B": [2 * unit] * stages}
    durations.update(I=[unit] * stages, W=[unit] * stages)
    exposed = {"F": [unit / 2] * stages, "B": [unit] * stages}  # half of each
    _, busy = simulate(order, rank_of, durations, 0.0)
    _, paired_busy = simulate(order, rank_of, durations, 0.0, exposed)
    for r in range(pp):
        pairs = sum(a[0] == "FB" for a in order[r])
        assert pairs > 0
        # F: 0.5 a2a + 0.5 compute; B: 1 a2a + 1 compute -> min(0.5, 1) + min(1, 0.5)
        assert busy[r] - paired_busy[r] == pytest.approx(pairs * unit)
