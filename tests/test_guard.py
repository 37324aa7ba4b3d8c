"""Bad steps are skipped, not applied (moetrain/loop/guard.py), on every layout.

A step whose gradients hold a NaN (`debug.inject_nonfinite_step`, a real NaN in a gradient
shard on every rank) must leave parameters, optimizer state and buffers (the routing bias
and its counts) bit-identical to the step before, and the run must then go on exactly as a
run whose data never held that batch: same losses, bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from moetrain import train
from moetrain.config import load_config, resume_notes
from moetrain.loop.guard import MIN_SPIKE_HISTORY, StepGuard, likely_cause
from moetrain.parallelisms.dims import ParallelDims
from tests.distributed import ROOT, launch_train, read_metrics, run_distributed
from tests.parity import TINY, TINY_DSV3, _full
from tests.test_host_reads import HostReads
from tests.test_mixture import DEBUG, _refused

# --- the rule itself ----------------------------------------------------------------------


def test_non_finite_loss_or_norm_is_skipped_and_counted():
    guard = StepGuard(max_consecutive=2, spike_sigma=0.0, spike_window=10)
    assert not guard.judge(2.0, 1.0).skip
    verdict = guard.judge(float("nan"), 1.0)
    assert verdict.skip and "loss nan" in verdict.reason
    assert not guard.limit_reached
    verdict = guard.judge(2.0, float("inf"))
    assert verdict.skip and "grad norm inf" in verdict.reason
    assert guard.limit_reached and guard.skipped_total == 2
    assert not guard.judge(2.0, 1.0).skip
    assert guard.consecutive == 0 and guard.skipped_total == 2 and not guard.limit_reached


def test_spike_rule_waits_for_history_and_judges_mean_plus_sigma():
    guard = StepGuard(max_consecutive=0, spike_sigma=3.0, spike_window=50)
    # Before MIN_SPIKE_HISTORY applied steps nothing spikes, however large.
    for i in range(MIN_SPIKE_HISTORY):
        assert not guard.judge(2.0 + 0.01 * (i % 2), 1.0 + 0.1 * (i % 2)).skip
    # mean 1.05, sd 0.05 for the norm: 1.05 + 3 * 0.05 = 1.2 is the limit.
    assert not guard.judge(2.0, 1.19).skip
    verdict = guard.judge(2.0, 5.0)
    assert verdict.skip and "grad norm 5" in verdict.reason and "mean + 3 sd" in verdict.reason
    # A skipped value does not enter the history; the state round-trips.
    clone = StepGuard(max_consecutive=0, spike_sigma=3.0, spike_window=50)
    clone.load_state_dict(guard.state_dict())
    assert clone.state_dict() == guard.state_dict() and 5.0 not in clone.norms
    assert not guard.limit_reached  # 0 = never stop


def test_a_spike_window_too_short_to_judge_is_refused_with_the_fix(capsys, monkeypatch):
    # Windows of 2-9 steps never held MIN_SPIKE_HISTORY losses: spike skipping was silently off.
    err = _refused(
        [DEBUG, "--train.skip_spike_sigma=3", f"--train.skip_spike_window={MIN_SPIKE_HISTORY - 1}"],
        capsys,
        monkeypatch,
    )
    assert f"train.skip_spike_window must be >= {MIN_SPIKE_HISTORY}" in err
    assert "train.skip_spike_sigma=0 turns spike skipping off" in err
    cfg = load_config([f"--train.skip_spike_window={MIN_SPIKE_HISTORY}"])
    assert cfg.train.skip_spike_window == MIN_SPIKE_HISTORY
    with pytest.raises(ValueError, match="never judge"):
        StepGuard(max_consecutive=0, spike_sigma=3.0, spike_window=MIN_SPIKE_HISTORY - 1)


def test_an_injection_the_run_never_reaches_is_refused_or_noted(capsys, monkeypatch):
    err = _refused(
        [DEBUG, "--train.steps=3", "--debug.inject_nonfinite_step=4"], capsys, monkeypatch
    )
    assert "debug.inject_nonfinite_step=4 is past the run's last step (train.steps=3)" in err
    # Injections that run off the end (issue 64, item 11): 4 of 5 would never happen.
    argv = [
        "--train.steps=3",
        "--debug.inject_nonfinite_step=3",
        "--debug.inject_nonfinite_count=5",
    ]
    err = _refused([DEBUG, *argv], capsys, monkeypatch)
    assert "debug.inject_nonfinite_count=5 from debug.inject_nonfinite_step=3 reaches step 7" in err
    assert "4 of its injections would never happen" in err
    assert "debug.inject_nonfinite_count=1 or less" in err
    load_config([*argv[:2], "--debug.inject_nonfinite_count=1"])  # the last step alone: runs
    # Before the step a run resumes after: accepted (a run from scratch injects), noted.
    argv = [
        "--train.steps=10",
        "--debug.inject_nonfinite_step=3",
        "--debug.inject_nonfinite_count=2",
    ]
    cfg = load_config(argv)
    notes = resume_notes(cfg, resume_step=4)
    assert len(notes) == 1 and notes[0].startswith("debug.inject_nonfinite_step=3 injects")
    assert "5..10" in notes[0]
    assert resume_notes(cfg, resume_step=3) == []  # step 4 is still injected


def test_the_likely_cause_names_an_auxiliary_loss_that_outweighs_the_token_loss():
    aux, z = "model.router_aux_loss_coef", "moe.z_loss_coef"
    coefs = {"aux_loss": (aux, 0.01), "z_loss": (z, 1e30)}
    record = {"loss": 5.76, "aux_loss": 2.28, "z_loss": 4.31, "skipped": "grad norm inf"}
    cause = likely_cause(record, coefs, untouched=True)
    assert cause.startswith("moe.z_loss_coef=1e+30 weighs z_loss 4.31 to 4.31e+30")
    assert cause.endswith("Lower moe.z_loss_coef (0.001 to 0.01 is usual)")
    big_aux = likely_cause(record, {"aux_loss": (aux, 100.0)}, untouched=False)
    assert big_aux.startswith("model.router_aux_loss_coef=100 weighs aux_loss 2.28 to 228")
    # Usual weights: not the auxiliary losses. With no update applied, not the lr either.
    usual = {"aux_loss": (aux, 0.01), "z_loss": (z, 0.001)}
    assert "train.lr played no part" in likely_cause(record, usual, untouched=True)
    assert likely_cause(record, usual, untouched=False).startswith("Lower train.lr")
    # A non-finite token loss is not the auxiliary losses' doing, even when they are NaN too.
    nan = {"loss": math.nan, "aux_loss": math.nan, "z_loss": math.nan}
    assert likely_cause(nan, coefs, untouched=False).startswith("Lower train.lr")


def _launch_one_rank(argv: list[str], tmp_path, capsys, monkeypatch) -> tuple[int, str]:
    """train.main in this process, one rank (the path of a plain `python train.py`)."""
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    code = train.main([*TINY, f"--job.output_dir={tmp_path / 'run'}", *argv])
    return code, capsys.readouterr().err


@pytest.mark.slow  # two short trainings, in this process
def test_a_run_that_applied_no_update_exits_3_naming_the_auxiliary_loss(
    tmp_path, capsys, monkeypatch
):
    """issue 52, items 17 and 23: every step skipped printed "done: loss nan -> nan" and exited
    0; the skip limit said "Lower train.lr" where moe.z_loss_coef=1e30 overflowed the
    gradient."""
    huge = "--moe.z_loss_coef=1e30"
    code, err = _launch_one_rank([huge, "--train.steps=2"], tmp_path, capsys, monkeypatch)
    assert code == 3, err
    assert err.startswith("error: this run applied no update: steps 1-2 were all skipped")
    assert "moe.z_loss_coef=1e+30 weighs z_loss" in err and "Traceback" not in err
    # The skip limit, the same advice (the weights of step 0: not train.lr's doing either).
    argv = [huge, "--train.steps=4", "--train.max_skipped_steps=2"]
    code, err = _launch_one_rank(argv, tmp_path / "limit", capsys, monkeypatch)
    assert code == 3, err
    assert err.startswith("error: steps 1-2 were all skipped (train.max_skipped_steps=2")
    assert "Lower moe.z_loss_coef" in err and "Lower train.lr" not in err


# --- on every layout ----------------------------------------------------------------------

INJECT = 2  # the step made non-finite
STEPS = 4


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    """Every parameter, optimizer state tensor and buffer, as full tensors."""
    names = {p: n for n, p in trainer.model.named_parameters()}
    out = {f"param {n}": _full(p) for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        out.update({f"optim {names[p]}.{k}": _full(v) for k, v in state.items()})
    out.update({f"buffer {n}": b.clone() for n, b in trainer.model.named_buffers()})
    return out


def _guard_worker(rank: int, world: int, argv: list[str], out_path: str) -> None:
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer

    def trainer_for(extra: list[str]) -> Trainer:
        cfg = load_config([*argv, *extra])
        p = cfg.parallel
        dims = ParallelDims.of(p, world)
        corpora = preflight(cfg, dims)
        return Trainer(cfg, dims, corpora)

    # A: step INJECT gets a NaN gradient. Each step is queued under a mode that counts the
    # host reads of tensor values inside it (moetrain/loop/step.py: none on the default path).
    a = trainer_for([f"--debug.inject_nonfinite_step={INJECT}"])
    assert a.optimizer.defaults.get("fused"), "the default path is fused AdamW"
    records, states, reads = [], [_snapshot(a)], []
    for _ in range(STEPS):
        batches = a.next_micro_batches()
        with HostReads() as seen:
            queued = a.steps.queue_step(batches)
        reads.append(seen.reads)
        records.append(a.steps.settle(queued))
        states.append(_snapshot(a))
    # B: the same run, but its data skips the batch of step INJECT.
    b = trainer_for([])
    b_losses = []
    for step in range(1, STEPS):
        if step == INJECT:
            b.next_micro_batches()  # consumed, never trained on
        b_losses.append(b.steps.train_step(b.next_micro_batches())["loss"])
    flags = [None] * world
    dist.all_gather_object(flags, [r.get("skipped") for r in records])
    if rank == 0:
        out = {"records": records, "states": states, "b": b_losses, "flags": flags}
        torch.save({**out, "reads": reads}, out_path)


GUARD_LAYOUTS = {
    "1rank": (1, TINY),
    "fsdp2": (2, TINY),
    "dsv3_ep2": (2, [*TINY_DSV3, "--parallel.ep=2"]),  # routing bias and its counts
    "cp2": (2, [*TINY, "--parallel.cp=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GUARD_LAYOUTS))
def test_injected_nan_step_is_skipped_on_every_rank_and_changes_nothing(name, tmp_path):
    world, argv = GUARD_LAYOUTS[name]
    run_distributed(_guard_worker, world, argv, str(tmp_path / "out.pt"))
    check_skip_changed_nothing(torch.load(tmp_path / "out.pt"), routing_bias=name == "dsv3_ep2")


def check_skip_changed_nothing(
    out: dict, routing_bias: bool, loss_rtol: float = 0.0, allowed_reads: str | None = None
) -> None:
    """What `_guard_worker` saved: no host read, step INJECT skipped on every rank and
    nothing moved over it, and the run after it is the run whose data lacked that batch
    (bitwise; within `loss_rtol` where the device's backward sums by atomics, as CUDA's).
    `allowed_reads`: a file whose reads are allowed (one the issue names)."""
    records, states = out["records"], out["states"]
    # No step read a tensor's value on the host while it was being queued, the skipped one
    # included (`.tolist()` on CPU escapes the mode: test_host_reads.py checks the code).
    reads = [[r for r in step if allowed_reads is None or allowed_reads not in r]
             for step in out["reads"]]  # fmt: skip
    assert reads == [[]] * STEPS
    # Every rank skipped step INJECT, and only it.
    for rank_flags in out["flags"]:
        assert [f is not None for f in rank_flags] == [s == INJECT for s in range(1, STEPS + 1)]
    assert "grad norm nan" in records[INJECT - 1]["skipped"]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1]
    # Nothing moved over the skipped step; everything moved over the others.
    before, after = states[INJECT - 1], states[INJECT]
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), f"{key} changed over the skipped step"
    moved = [
        k
        for k in states[1]
        if k.startswith("param") and not torch.equal(states[0][k], states[1][k])
    ]
    assert moved, "the applied step should have moved the parameters"
    if routing_bias:
        bias = [k for k in before if k.endswith("correction_bias")]
        assert bias and any(not torch.equal(states[0][k], states[1][k]) for k in bias)
    # The rest of the run is the run whose data skipped that batch, bit for bit.
    a_losses = [r["loss"] for r in records]
    b_losses = [*out["b"][: INJECT - 1], math.nan, *out["b"][INJECT - 1 :]]
    for step, (a, b) in enumerate(zip(a_losses, b_losses), 1):
        if step != INJECT:
            assert a == b if loss_rtol == 0 else math.isclose(a, b, rel_tol=loss_rtol), step
    assert all(math.isfinite(x) for x in a_losses)


@pytest.mark.slow
def test_consecutive_skips_stop_with_exit_3_and_a_resumable_checkpoint(tmp_path):
    out_dir = tmp_path / "run"
    argv = [
        *TINY,
        "--train.steps=6",
        "--train.max_skipped_steps=3",
        "--debug.inject_nonfinite_step=2",
        "--debug.inject_nonfinite_count=5",
        "--metrics.jsonl=true",
        "--metrics.log_interval=1",
    ]
    proc = launch_train(argv, out_dir)
    proc.wait(timeout=300)
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 3, log[-3000:]
    assert "error: steps 2-4 were all skipped" in log and "step-4" in log
    assert "Traceback" not in log
    assert (out_dir / "checkpoints" / "step-4" / "COMPLETE").is_file()
    # Resumed without the fault, the run finishes from there.
    proc = launch_train([a for a in argv if not a.startswith("--debug.")], out_dir)
    proc.wait(timeout=300)
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "resumed from" in log and "step-4" in log
    records = read_metrics(out_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [bool(r.get("skipped")) for r in records] == [False, True, True, True, False, False]
    assert records[-1]["skipped_steps"] == 3 and math.isfinite(records[-1]["loss"])
