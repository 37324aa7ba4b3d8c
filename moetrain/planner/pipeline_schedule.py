"""A pipeline schedule's order of actions, and what it implies for the planner
(`moetrain.planner.pipeline_cost`): how many micro-batches a rank holds at once, and how
long a step's actions take when each waits for its input.

The order is torch's own: `schedule_order` builds the schedule over placeholder stages on
a group of the fake process group and reads its actions (1F1B's written out as its
runtime runs it).
"""

from __future__ import annotations

# An action: (kind, stage, micro-batch) with kind F (forward), B (full backward), I (input
# backward), W (weight backward); or ("FB", (forward action, backward action)): DualPipeV
# running a forward and a backward of two chunks as one.
Action = tuple


def schedule_order(schedule: str, pp: int, virtual: int, micro_batches: int) -> dict:
    """pp rank -> its compute actions, in the order torch's schedule runs them (built over
    placeholder stages on a group of the fake process group: only the order is read)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from moetrain.parallelisms.dims import stage_rank, stages_per_rank
    from moetrain.parallelisms.pipeline import SCHEDULE_CLASSES

    if schedule == "1F1B":
        return {r: _one_f_one_b(r, pp, micro_batches) for r in range(pp)}
    num_stages = pp * stages_per_rank(schedule, virtual)
    group = dist.new_group(list(range(pp)))
    x = torch.empty(1, 1, device="meta")
    stages = [
        PipelineStage(nn.Identity(), s, num_stages, torch.device("cpu"), x, x, group=group)
        for s in range(num_stages)
        if stage_rank(s, pp, schedule) == 0
    ]
    built = SCHEDULE_CLASSES[schedule](stages, micro_batches, scale_grads=False)
    computes = ("F", "B", "I", "W", "OVERLAP_F_B")
    return {
        r: [_plain(a) for a in acts if a is not None and a.computation_type.value in computes]
        for r, acts in built.pipeline_order.items()
    }


def _one_f_one_b(rank: int, pp: int, n: int) -> list[Action]:
    """Schedule1F1B's order as its runtime runs it (its `_get_pipeline_order`, a display
    aid, numbers later ranks' micro-batches from 1): min(n, pp - rank) forwards, then a
    backward and a forward in turn, then the backwards left."""
    warmup = min(n, pp - rank)
    out: list[Action] = [("F", rank, m) for m in range(warmup)]
    for m in range(n):
        out.append(("B", rank, m))
        if warmup + m < n:
            out.append(("F", rank, warmup + m))
    return out


def _plain(action) -> Action:
    if action.sub_actions:
        return ("FB", tuple(_plain(a) for a in action.sub_actions))
    return (action.computation_type.value, action.stage_index, action.microbatch_index)


def _steps(action: Action) -> tuple:
    return action[1] if action[0] == "FB" else (action,)


def held_peak(actions: list[Action], saved: list[float]) -> float:
    """The most activation bytes a rank's actions hold at once: a micro-batch's stage
    saves `saved[stage]` at its forward and frees it at its full or weight backward."""
    held = peak = 0.0
    for action in actions:
        for kind, stage, _ in _steps(action):
            if kind == "F":
                held += saved[stage]
                peak = max(peak, held)
            elif kind in ("B", "W"):
                held -= saved[stage]
    return peak


def simulate(
    order: dict,
    rank_of: list[int],
    durations: dict[str, list[float]],
    p2p_s: float,
    exposed: dict[str, list[float]] | None = None,
) -> tuple[float, list[float]]:
    """(the step's span, each pp rank's busy time): every rank runs its actions in order,
    each as soon as the rank is free and its input has arrived. `durations`: kind ->
    stage -> seconds; `p2p_s`: one send between two ranks. `exposed` ("F", "B" -> stage
    -> seconds): the expert all-to-all inside each forward and full backward, when a
    DualPipeV pair runs its two at once (moetrain/parallelisms/pipeline_overlap.py): each one's
    transfers then hide under the other's compute, up to that compute's time."""
    last = len(rank_of) - 1
    done: dict[tuple, float] = {}  # (kind, stage, mb) -> end; ("G", s, mb): input grad out

    def hop(frm: int, to: int) -> float:
        return p2p_s if rank_of[frm] != rank_of[to] else 0.0

    def ready(kind: str, s: int, m: int) -> float | None:
        if kind == "F":
            if s == 0:
                return 0.0
            t = done.get(("F", s - 1, m))
            return None if t is None else t + hop(s - 1, s)
        if kind == "W":
            return done.get(("I", s, m))
        t = done.get(("F", s, m))  # B or I
        if t is None or s == last:
            return t
        g = done.get(("G", s + 1, m))
        return None if g is None else max(t, g + hop(s + 1, s))

    ranks = sorted(order)
    at, free, busy = dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0.0), dict.fromkeys(ranks, 0.0)
    left = sum(len(a) for a in order.values())
    while left:
        moved = False
        for r in ranks:
            actions = order[r]
            while at[r] < len(actions):
                steps = _steps(actions[at[r]])
                times = [ready(*s) for s in steps]
                if any(t is None for t in times):
                    break
                took = sum(durations[kind][s] for kind, s, _ in steps)
                if exposed is not None and len(steps) == 2:
                    took -= _pair_hidden(steps, durations, exposed)
                end = max(free[r], *times) + took
                for kind, s, m in steps:
                    done[(kind, s, m)] = end
                    if kind in ("B", "I"):
                        done[("G", s, m)] = end
                free[r], busy[r] = end, busy[r] + took
                at[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError("the pipeline order waits on itself (a torch schedule changed?)")
    return max(free.values()), [busy[r] for r in ranks]


def _pair_hidden(steps: tuple, durations: dict, exposed: dict) -> float:
    """Seconds an overlapped (forward, full backward) pair hides: each side's all-to-all
    under the other side's compute (its time less its own all-to-all)."""
    (_, f, _), (_, b, _) = steps
    a_f, a_b = exposed["F"][f], exposed["B"][b]
    compute_f, compute_b = durations["F"][f] - a_f, durations["B"][b] - a_b
    return min(a_f, compute_b) + min(a_b, compute_f)
