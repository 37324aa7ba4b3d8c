"""Values a run accepts that do nothing in it, or act other than their name says: one
console line each (`moetrain/config/notes.py`), never a refusal."""

from __future__ import annotations

from moetrain.config import load_config, startup_notes


def test_a_cp_layout_without_context_parallel_ranks_is_noted():
    notes = startup_notes(load_config(["--parallel.cp_layout=balanced"]))
    assert [n for n in notes if n.startswith("parallel.cp_layout=balanced has no effect")]
    assert startup_notes(load_config([])) == []  # the default layout: nothing to say
    cfg = load_config(["--parallel.cp_layout=balanced", "--parallel.cp=2"])
    assert not [n for n in startup_notes(cfg) if "parallel.cp_layout" in n]


def test_a_global_batch_aux_loss_under_accumulation_is_noted_with_its_real_scope():
    """moe.aux_loss_mode=global_batch spans one accumulation round (docs/parallelisms.md,
    "Loss and gradient scale"): its value follows the data-parallel degree."""
    from moetrain.parallelisms.dims import ParallelDims

    argv = ["--moe.aux_loss_mode=global_batch", "--train.global_batch_size=16"]
    cfg = load_config([*argv, "--train.micro_batch_size=4"])
    notes = startup_notes(cfg, ParallelDims.of(cfg.parallel, 2))
    assert notes == [
        "moe.aux_loss_mode=global_batch balances over one accumulation round, not the global "
        "batch: 2 data-parallel rank(s) x train.micro_batch_size=4 = 8 of its 16 sequences, "
        "so another data-parallel degree gives another aux loss; train.micro_batch_size=8 "
        "makes the round the whole global batch"
    ]
    one = startup_notes(cfg, ParallelDims.of(cfg.parallel, 1))
    assert len(one) == 1 and "4 of its 16 sequences, the same statistics as micro_batch" in one[0]
    whole = load_config([*argv, "--train.micro_batch_size=8"])  # no accumulation at 2 ranks
    assert startup_notes(whole, ParallelDims.of(whole.parallel, 2)) == []
    assert startup_notes(cfg) == []  # without the layout: nothing to say


def test_virtual_stages_that_the_schedule_does_not_read_are_noted():
    pp2 = ["--parallel.pp=2", "--parallel.pp_virtual_stages=3"]
    for schedule, held in (("1F1B", "one stage"), ("DualPipeV", "two stages in a V")):
        (note,) = startup_notes(load_config([*pp2, f"--parallel.pp_schedule={schedule}"]))
        assert note.startswith(
            f"parallel.pp_virtual_stages=3 has no effect with parallel.pp_schedule={schedule}"
        )
        assert held in note and "Interleaved1F1B" in note
    (note,) = startup_notes(load_config(["--parallel.pp_virtual_stages=3"]))
    assert note.startswith("parallel.pp_virtual_stages=3 has no effect with parallel.pp=1")
    # where it acts, and the default under any schedule: nothing to say
    assert startup_notes(load_config([*pp2, "--parallel.pp_schedule=Interleaved1F1B"])) == []
    assert (
        startup_notes(load_config(["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble"]))
        == []
    )


def test_a_ring_kernel_without_a_ring_is_noted():
    notes = startup_notes(load_config(["--parallel.cp_kernel=math"]))
    assert notes == [
        "parallel.cp_kernel=math has no effect with parallel.cp=1: it picks the "
        "context-parallel ring's block kernel (only flash_attn also replaces the attention "
        "core without a ring)"
    ]
    assert startup_notes(load_config(["--parallel.cp_kernel=math", "--parallel.cp=2"])) == []


def test_a_warmup_longer_than_the_run_is_noted():
    notes = startup_notes(load_config(["--train.steps=4", "--train.warmup_steps=10"]))
    assert notes == [
        "train.warmup_steps=10 is longer than the run (train.steps=4): the learning rate "
        "warms up over all 4 steps, reaching train.lr at the last one, and never decays"
    ]
    assert startup_notes(load_config(["--train.steps=10", "--train.warmup_steps=10"])) == []


def test_save_frozen_without_lora_is_noted():
    notes = startup_notes(load_config(["--checkpoint.save_frozen=true"]))
    assert [n for n in notes if n.startswith("checkpoint.save_frozen=true has no effect")]
    cfg = load_config(["--checkpoint.save_frozen=true", "--peft.method=lora"])
    assert not [n for n in startup_notes(cfg) if "save_frozen" in n]


def test_bf16_moments_with_a_slow_second_moment_are_noted_with_what_the_optimizer_keeps():
    """bf16 keeps 8 significant bits: beta2 x v rounds back to v once 1 - beta2 is under
    half of the spacing below v (2^-9 of v at a power of two, up to 2^-8). The note's
    figures are the real optimizer's: v = 1, then 200 steps of zero gradient leave it at 1.0
    in bf16 against 0.819 in fp32 (beta2 = 0.999)."""
    from dataclasses import replace

    import torch
    from torch import nn

    from moetrain.build.optimizer import build_optimizer

    def kept(beta2: float, dtype: str) -> float:  # v after 200 zero-gradient steps
        cfg = load_config([f"--train.beta2={beta2}", f"--train.optimizer_state_dtype={dtype}"])
        p = nn.Parameter(torch.ones(1))
        opt = build_optimizer(nn.ParameterList([p]), replace(cfg.train, weight_decay=0.0))
        p.grad = torch.ones(1)
        opt.step()
        opt.state[p]["exp_avg_sq"].fill_(1.0)
        for _ in range(200):
            p.grad = torch.zeros(1)
            opt.step()
        return opt.state[p]["exp_avg_sq"].item()

    for beta2, stored, exact in ((0.999, "1", "0.819"), (0.998, "0.977", "0.670")):
        assert f"{kept(beta2, 'bf16'):.3g}" == stored
        assert f"{kept(beta2, 'fp32'):.3f}" == exact
        bf16 = ["--train.optimizer_state_dtype=bf16", f"--train.beta2={beta2}"]
        (note,) = [n for n in startup_notes(load_config(bf16)) if n.startswith("train.beta2")]
        assert f"v = 1 is {stored} in bf16 against {exact} in fp32" in note
    assert kept(0.99, "bf16") < 0.2  # 1 - beta2 above 2^-8: it decays, and nothing is said
    for dtype, beta2 in (("bf16", 0.99), ("bf16", 0.996), ("fp32", 0.999)):
        argv = [f"--train.optimizer_state_dtype={dtype}", f"--train.beta2={beta2}"]
        assert not [n for n in startup_notes(load_config(argv)) if n.startswith("train.beta2")]


def test_a_resume_that_changes_the_moments_dtype_says_how_they_are_cast():
    """Noted, not refused: bf16 -> fp32 widens exactly, fp32 -> bf16 rounds once (what every
    bf16 step rounds); the same dtype, or a checkpoint from before the key (fp32), is quiet."""
    from moetrain.config import moment_dtype_notes

    def saved(dtype: str) -> dict:
        return {"train": {"optimizer_state_dtype": dtype}}

    bf16 = load_config(["--train.optimizer_state_dtype=bf16"])
    (note,) = moment_dtype_notes(bf16, saved("fp32"), "ck/step-2")
    assert note.startswith(
        "train.optimizer_state_dtype=bf16, but ck/step-2 holds Adam's moments in fp32: they "
        "are rounded to bf16 once"
    )
    (note,) = moment_dtype_notes(load_config([]), saved("bf16"), "ck/step-2")
    assert "they are widened to fp32 exactly" in note
    assert moment_dtype_notes(bf16, saved("bf16"), "ck") == []
    assert moment_dtype_notes(load_config([]), {"train": {}}, "ck") == []
    assert moment_dtype_notes(bf16, {}, "ck")  # an old checkpoint's moments were fp32
