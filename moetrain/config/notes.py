"""Values a run accepts that do nothing in it (or, given the layout, something other than
their name says): one console line each, not a refusal.

A refusal is for a value no run can use (`checks.py`); these are fine in another run (a
longer one, one with more context-parallel ranks, one started from scratch), so the run goes
on and says which key has no effect and what would give it one. `startup_notes` needs the
config alone (`train.py` prints them once the preflight passed); `resume_notes` needs the
step a resumed run starts after, which only the trainer knows once it read the checkpoint.
"""

from __future__ import annotations

import struct
from dataclasses import fields

from moetrain.config.schema import JobConfig, ParallelSection
from moetrain.parallelisms.dims import ParallelDims


def _default(cls: type, name: str) -> object:
    return next(f.default for f in fields(cls) if f.name == name)


def _global_aux_note(cfg: JobConfig, dims: ParallelDims) -> list[str]:
    """`moe.aux_loss_mode=global_batch` under accumulation: its statistics span one round
    (every data-parallel rank's micro-batch), not the global batch, so the aux loss follows
    the data-parallel degree (moetrain.loop.losses.aux_loss_share); at one data-parallel
    rank a round is one micro-batch, micro_batch's statistics exactly."""
    t = cfg.train
    if cfg.moe.aux_loss_mode != "global_batch":
        return []
    rounds = dims.grad_accum(t.global_batch_size, t.micro_batch_size)
    if rounds == 1:  # the round is the global batch: what the name says, on every layout
        return []
    dp = dims.dp_size
    same = ", the same statistics as micro_batch" if dp == 1 else ""
    return [
        f"moe.aux_loss_mode=global_batch balances over one accumulation round, not the global "
        f"batch: {dp} data-parallel rank(s) x train.micro_batch_size={t.micro_batch_size} = "
        f"{dp * t.micro_batch_size} of its {t.global_batch_size} sequences{same}, so another "
        "data-parallel degree gives another aux loss; train.micro_batch_size="
        f"{t.global_batch_size // dp} makes the round the whole global batch"
    ]


# 1 - beta2 below which a bf16 second moment can stop decaying: bf16 keeps 8 significant
# bits, so a value v = m x 2^e (1 <= m < 2) is 2^(e-7) from its lower neighbour, 2^(e-8)
# for m = 1; `beta2 * v` rounds back to v (round to nearest) once (1 - beta2) m < 2^-8.
_BF16_STUCK_DECAY = 2.0**-8


def _to_bf16(x: float) -> float:
    """`x` rounded to bf16 (through fp32, to nearest even), as torch's `.bfloat16()`."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bf16_moment_decay_note(t) -> list[str]:
    """`train.optimizer_state_dtype=bf16` with beta2 close to 1: a step widens exp_avg_sq,
    multiplies it by beta2 and rounds it back to bf16, which gives the same value whenever
    the decay is under half of bf16's spacing there. Then v stops decaying where gradients
    shrink (after a spike, for rarely used rows) and the update stays damped."""
    decay = 1 - t.beta2
    if t.optimizer_state_dtype != "bf16" or decay >= _BF16_STUCK_DECAY:
        return []
    stored = exact = 1.0  # v after a gradient of 1, then 200 steps of zero gradient
    for _ in range(200):
        stored, exact = _to_bf16(stored * t.beta2), exact * t.beta2
    every = decay < _BF16_STUCK_DECAY / 2  # below 2^-9: every value sticks
    which = "every v" if every else f"v of mantissa below {_BF16_STUCK_DECAY / decay:.2f}"
    return [
        f"train.beta2={t.beta2:g} with train.optimizer_state_dtype=bf16: Adam's second moment "
        f"stops decaying where the gradients shrink, since beta2 x v rounds back to v in bf16 "
        f"for {which} (1 - beta2 = {decay:.3g} is under half of bf16's spacing, 2^-9 to 2^-8 "
        f"of v): after 200 steps of zero gradient v = 1 is {stored:.3g} in bf16 against "
        f"{exact:.3f} in fp32, so those updates stay damped; train.optimizer_state_dtype=fp32 "
        f"or train.beta2 <= {1 - _BF16_STUCK_DECAY:.4f} lets it decay"
    ]


def startup_notes(cfg: JobConfig, dims: ParallelDims | None = None) -> list[str]:
    """What in `cfg` has no effect in this run, whatever it resumes from, or (with the
    layout, `dims`) acts other than its name says."""
    p, t = cfg.parallel, cfg.train
    notes = [] if dims is None else _global_aux_note(cfg, dims)
    # Only a layout other than the default: the config does not record which keys were set,
    # and a note on every one-rank run's default would be noise.
    if p.cp == 1 and p.cp_layout != _default(ParallelSection, "cp_layout"):
        notes.append(
            f"parallel.cp_layout={p.cp_layout} has no effect with parallel.cp=1: one "
            "context-parallel rank holds every sequence whole"
        )
    if p.cp == 1 and p.cp_kernel not in ("auto", "flash_attn"):
        notes.append(
            f"parallel.cp_kernel={p.cp_kernel} has no effect with parallel.cp=1: it picks the "
            "context-parallel ring's block kernel (only flash_attn also replaces the attention "
            "core without a ring)"
        )
    if t.warmup_steps > t.steps:
        notes.append(
            f"train.warmup_steps={t.warmup_steps} is longer than the run (train.steps="
            f"{t.steps}): the learning rate warms up over all {t.steps} steps, reaching "
            "train.lr at the last one, and never decays"
        )
    if t.optimizer_state_dtype != "fp32":
        notes.append(
            f"train.optimizer_impl={t.optimizer_impl} has no effect with "
            f"train.optimizer_state_dtype={t.optimizer_state_dtype}: AdamW steps one parameter "
            "at a time, widening its moments to fp32 (moetrain/build/adamw_bf16.py), and the host "
            "reads the step's verdict before the update"
        )
    notes += _bf16_moment_decay_note(t)
    if cfg.checkpoint.save_frozen and cfg.peft.method == "none":
        notes.append(
            "checkpoint.save_frozen=true has no effect with peft.method=none: nothing is "
            "frozen, so every checkpoint holds every weight"
        )
    virtual = p.pp_virtual_stages
    if virtual != _default(ParallelSection, "pp_virtual_stages"):
        if p.pp == 1:
            notes.append(
                f"parallel.pp_virtual_stages={virtual} has no effect with parallel.pp=1: no "
                "pipeline runs; it sets the stages per rank of pp_schedule=Interleaved1F1B"
            )
        elif p.pp_schedule != "Interleaved1F1B":
            held = "one stage" if p.pp_schedule == "1F1B" else "two stages in a V"
            notes.append(
                f"parallel.pp_virtual_stages={virtual} has no effect with parallel.pp_schedule="
                f"{p.pp_schedule}, which holds {held} per rank; it sets the stages per rank of "
                "pp_schedule=Interleaved1F1B alone"
            )
    run_samples = t.steps * t.global_batch_size
    total = sum(table.weight for table in cfg.data.mix)
    for i, table in enumerate(cfg.data.mix, start=1):
        share = table.weight / total * run_samples
        # The blend keeps each source within one sample of its share (moetrain/data/mixture.py),
        # so a share below one is at most one sample, and most often none.
        if share < 1:
            notes.append(
                f"data.mix[{i}] ({table.name or table.path}) has weight {table.weight:g} of "
                f"{total:g}: {share:.3g} of the run's {run_samples:,} samples (train.steps x "
                "train.global_batch_size), so it gives at most one sample; raise its weight or "
                "remove the table"
            )
    return notes


def moment_dtype_notes(cfg: JobConfig, saved_config: dict | None, path: str) -> list[str]:
    """A run that loads Adam's moments saved in another `train.optimizer_state_dtype`
    (`saved_config`: the checkpoint's config as its trainer state records it). Noted, not
    refused: the load casts (moetrain/build/adamw_bf16.py), bf16 -> fp32 exactly and fp32 ->
    bf16 by rounding each moment once, a relative 2^-9 at most, the rounding every bf16
    step applies to them anyway."""
    train = (saved_config or {}).get("train", {})
    saved = train.get("optimizer_state_dtype", "fp32")  # checkpoints from before the key
    ours = cfg.train.optimizer_state_dtype
    if saved == ours:
        return []
    how = (
        "widened to fp32 exactly"
        if ours == "fp32"
        else "rounded to bf16 once (a relative 2^-9 at most, what each bf16 step rounds)"
    )
    return [
        f"train.optimizer_state_dtype={ours}, but {path} holds Adam's moments in {saved}: "
        f"they are {how}; train.optimizer_state_dtype={saved} keeps them as saved"
    ]


def resume_notes(cfg: JobConfig, resume_step: int) -> list[str]:
    """What in `cfg` would have acted at or before `resume_step`, the step of the checkpoint
    the run resumed from (it goes on with step resume_step + 1), and so never acts."""
    if resume_step >= cfg.train.steps:
        return []  # nothing is left to run: no key could act
    notes = []
    steps = cfg.profile.steps
    if len(steps) == 2 and steps[1] <= resume_step:
        notes.append(
            f"profile.steps={steps} lies before step {resume_step + 1}, where this run resumes: "
            f"nothing is profiled; give steps in {resume_step + 1}..{cfg.train.steps}"
        )
    d = cfg.debug
    last = d.inject_nonfinite_step + d.inject_nonfinite_count - 1
    if d.inject_nonfinite_step > 0 and last <= resume_step:
        at = f"step {last}" if d.inject_nonfinite_count == 1 else f"steps up to {last}"
        notes.append(
            f"debug.inject_nonfinite_step={d.inject_nonfinite_step} injects into {at}, before "
            f"step {resume_step + 1}, where this run resumes: nothing is injected; give a step "
            f"in {resume_step + 1}..{cfg.train.steps}"
        )
    return notes
