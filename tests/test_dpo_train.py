"""`train.objective=dpo` as a user runs it: what it does not combine with is refused by key
before any work; the reference is the LoRA model with its adapters off (the base, computed
by the same modules); a run on prepared pairs starts at the loss of a policy equal to its
reference and moves the rewards; the refusals that need the data."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.build.lora import adapters_disabled, apply_lora, init_adapters
from moetrain.config import ConfigError, load_config
from moetrain.errors import DataError
from moetrain.models import get_model_spec
from moetrain.models.common.lora import is_adapter
from moetrain.prepare.cli import main as prepare
from tests.chat_model import save_chat_model
from tests.test_preference_prepare import preference_pairs, prepare_pairs

BASE = ["--config=configs/debug_qwen3_moe.toml"]
DPO = [
    *BASE,
    "--train.objective=dpo",
    "--peft.method=lora",
    "--data.source=tokens",
    "--data.path=prepared",
]
FULL = [a for a in DPO if a != "--peft.method=lora"]  # dpo.reference=auto: stored


@pytest.mark.parametrize(
    "argv, problem",
    [
        ([*BASE, "--dpo.beta=0.2"], "dpo.beta is set, but train.objective=sft does not read it"),
        ([*DPO, "--dpo.loss=ipo", "--dpo.label_smoothing=0.1"], "dpo.label_smoothing=0.1 smooths"),
        ([*DPO, "--peft.method=none", "--dpo.reference=base"], "dpo.reference=base is the"),
        ([*DPO, "--dpo.reference=stored"], "dpo.reference=stored with peft.method=lora: the"),
        ([*DPO, "--dpo.reference=copy"], "dpo.reference=copy with peft.method=lora: the"),
        ([*FULL, "--dpo.reference=copy", "--parallel.pp=2"], "parallel.pp=2 with dpo.referen"),
        ([*FULL, "--parallel.cp=2"], "parallel.cp=2 with dpo.reference=stored is not done"),
        ([*FULL, "--parallel.pp=2"], "parallel.pp=2 with dpo.reference=stored is not done"),
        ([*DPO, "--peft.init_from=adapters"], "peft.init_from with train.objective=dpo"),
        ([*DPO, "--data.document_mask=false"], "data.document_mask=false with train.objective"),
        ([*DPO, "--data.reset_positions=false"], "data.reset_positions=false with train."),
        ([*DPO, "--data.source=stdlib", "--data.path=none"], "data.source=stdlib"),
        ([*DPO, "--data.path=none", "--data.mix=[{path='a'}]"], "[[data.mix]] with train."),
        ([*DPO, "--dpo.label_smoothing=0.5"], "dpo.label_smoothing"),
    ],
)
def test_what_dpo_does_not_take_is_refused_by_key(argv, problem):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert problem in str(info.value)


def test_adapters_off_is_the_base_and_back_on_after():
    cfg = load_config(
        [*BASE, "--peft.method=lora", "--peft.rank=4", '--peft.targets=["attention", "experts"]']
    )
    spec = get_model_spec(cfg.model.name)
    base = spec.build(cfg.model.args)
    base.init_weights(cfg.train.seed)
    model = spec.build(cfg.model.args)
    apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
    model.init_weights(cfg.train.seed)
    init_adapters(model, cfg.train.seed)
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        for name, param in model.named_parameters():
            if is_adapter(name) and name.endswith("lora_B"):
                param.normal_(0, 0.5)
    ids = torch.randint(0, cfg.model.args.vocab_size, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    adapted = model(ids, positions).logits
    with adapters_disabled(model):
        off = model(ids, positions).logits
    assert torch.equal(off, base(ids, positions).logits)
    assert (adapted - off).abs().max() > 1e-2
    assert torch.equal(model(ids, positions).logits, adapted)  # on again


@pytest.fixture(scope="module")
def pairs_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    save_chat_model(root / "model")
    prepare_pairs(preference_pairs(40), root / "model", root / "pairs")
    chosen = [{"messages": p["prompt"] + p["chosen"]} for p in preference_pairs(40)]
    (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chosen))
    argv = [
        "--source",
        "jsonl",
        "--format",
        "chat",
        "--path",
        str(root / "c.jsonl"),
        "--tokenizer",
        str(root / "model"),
        "--workers",
        "1",
    ]
    assert prepare([*argv, "--out", str(root / "chat")]) == 0
    return root


@pytest.mark.parametrize(
    "change, problem",
    [
        (["--train.objective=sft", "--peft.method=none"], "holds preference pairs"),
        (["--data.path={chat}"], "holds no preference pairs (prepared with --format chat)"),
        (["--eval.path={chat}"], "eval.path: "),
    ],
)
def test_data_of_the_other_objective_is_refused_before_training(pairs_run, change, problem):
    from moetrain.loop.preflight import preflight
    from moetrain.parallelisms.dims import ParallelDims

    argv = _dpo_args(pairs_run) + [c.format(chat=pairs_run / "chat") for c in change]
    cfg = load_config(argv)
    with pytest.raises(DataError) as info:
        preflight(cfg, ParallelDims.of(cfg.parallel, 1))
    assert problem in str(info.value)


def _dpo_args(root) -> list[str]:
    return [
        "--config=configs/finetune_chat.toml",
        f"--model.init_from_hf={root / 'model'}",
        f"--data.tokenizer={root / 'model'}",
        f"--data.path={root / 'pairs'}",
        "--data.seq_len=256",
        "--train.objective=dpo",
        "--peft.method=lora",
        "--train.steps=4",
        "--train.global_batch_size=4",
        "--train.lr=1e-3",
        "--train.warmup_steps=1",
        "--checkpoint.interval=0",
    ]


# The layouts trained in one launch of 4 ranks (dp 2 where no other degree takes the ranks):
# the pair loss under CP needs each document's sums over the cp ranks (and each pair counted
# once); under pipeline stages the last stage computes it, the reference runs through the
# stages forward only with every stage's adapters off.
DPO_LAYOUTS = {
    "fsdp4": ["--parallel.dp_shard=4"],
    "ep2": ["--parallel.ep=2"],
    "cp2_balanced": ["--parallel.cp=2", "--parallel.cp_layout=balanced"],
    "pp2_1f1b_cp2_zigzag": ["--parallel.pp=2", "--parallel.cp=2"],  # (cp's default layout)
    "pp2_interleaved": ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B"],
    "pp2_zbv": ["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble"],
    "pp2_dualpipev_ep2": ["--parallel.pp=2", "--parallel.pp_schedule=DualPipeV", "--parallel.ep=2"],
}


@pytest.mark.slow
def test_layouts_train_dpo_as_one_process(pairs_run, tmp_path):
    """Each of DPO_LAYOUTS with LoRA, then EP 2 x FSDP fine-tuning the whole model against
    the stored reference (its first pass shared out over the 4 ranks, the table gathered)
    and against the resident copy: each 3 steps in one launch (accumulation 2 or more), then
    its held-out pairs, against a plain process whose reference model is a separately built
    base (tests/dpo_parity.py): losses (with RPO's term), rewards, norms, every gradient and
    updated parameter within 1e-5 (3e-5 under CP: see below), and the held-out figures; and
    EP 2 x FSDP in bf16 against the same fp32 process within bf16's rounding."""
    from tests.distributed import run_distributed
    from tests.dpo_parity import FIGURES, dpo_reference_run, layouts_worker
    from tests.parity import TINY, assert_tensors_close

    tiny = [a for a in TINY if not a.startswith(("--data.seq_len", "--data.max_tokens"))]
    full = [
        *tiny,
        "--model.num_hidden_layers=4",  # a block per stage of the looped and V schedules
        "--data.source=tokens",
        f"--data.path={pairs_run / 'pairs'}",
        f"--data.tokenizer={pairs_run / 'model'}",
        "--data.seq_len=320",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=1",
        "--train.objective=dpo",
        "--dpo.beta=0.5",
        "--dpo.nll_weight=0.3",
        "--moe.z_loss_coef=0.05",
        "--train.lr=3e-3",
        "--eval.fraction=0.25",
        "--eval.samples=4",
    ]
    argv = [*full, "--peft.method=lora", "--peft.rank=4"]
    full.append(f"--job.output_dir={tmp_path / 'full'}")  # dpo.reference=auto: stored
    layouts = {name: [*argv, *layout] for name, layout in DPO_LAYOUTS.items()}
    layouts["ep2 full fine-tuning, stored reference"] = [*full, "--parallel.ep=2"]
    layouts["ep2 full, copy"] = [*full, "--parallel.ep=2", "--dpo.reference=copy"]
    layouts["ep2 bf16"] = [*argv, "--parallel.ep=2", "--train.mixed_precision=bf16"]
    run_distributed(layouts_worker, 4, list(layouts.values()), 3, str(tmp_path / "out.pt"))
    assert (tmp_path / "full" / "dpo_reference.safetensors").is_file()
    *ref, held_out = dpo_reference_run(argv, 3)
    *full_ref, full_held_out = dpo_reference_run(full, 3)
    for theirs, held in ((ref, held_out), (full_ref, full_held_out)):
        assert theirs[0]["loss"] > 0.6931471805599453  # the policy is its reference, plus RPO
        assert theirs[-1]["rewards/accuracy"] > 0 and theirs[-1]["pairs"] >= 8
        assert held["eval_pairs"] > 0
    results = zip(layouts.items(), torch.load(tmp_path / "out.pt"), strict=True)
    for (name, layout), records in results:
        *records, evaluation = records
        if "bf16" in name:
            _assert_bf16_dpo(records, ref)
            continue
        # the copy is the plain process's frozen base, and so is the stored first pass
        reference, held = (full_ref, full_held_out) if "full" in name else (ref, held_out)
        # NOTE: the ring's attention sums in another order than one process's, ~1e-7 of each
        # log-probability; a pair's gradient is the difference of its two sides', nearly
        # equal, and the smallest adapters' gradients (norm 6e-4 of 0.1) show that at up to
        # 1.2e-5 of their norm (1.6e-5 in a parameter after Adam), where the other layouts
        # stay under 3e-6. The figures and the norm stay within 1e-5.
        close = 3e-5 if "--parallel.cp=2" in layout else 1e-5
        for step, (ours, theirs) in enumerate(zip(records, reference, strict=True), start=1):
            for key in FIGURES:
                if key == "rewards/accuracy" and step == 1 and "stored" in name:
                    # NOTE: at step 1 the policy is the initial model, whose sums the first
                    # pass stored from other forwards (EP's expert GEMMs over other rows):
                    # each margin is 0 to rounding, and which side of 0 it lands on is
                    # noise; the rewards themselves are held to 0 below.
                    continue
                # A reward is beta times a difference of two sums of hundreds of fp32
                # log-probabilities: within 1e-5 of their size, not of the difference.
                tol = 3e-5 if key.startswith("rewards/") else 1e-7
                where = f"{name} step {step} {key}"
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=tol), where
            assert_tensors_close(ours["grads"], theirs["grads"], f"{name} step {step} grad", close)
            assert_tensors_close(ours["params"], theirs["params"], f"{name} step {step}", close)
        assert evaluation["eval_pairs"] == held["eval_pairs"], name
        for key, value in held.items():
            tol = 3e-5 if key.startswith("eval_rewards/") else 1e-7
            assert evaluation[key] == pytest.approx(value, rel=1e-5, abs=tol), f"{name} {key}"


def _assert_bf16_dpo(records: list[dict], fp32: list[dict]) -> None:
    """A bf16 DPO run (EP 2 x FSDP, LoRA) against the fp32 plain process. At step 1 the
    policy is its reference bit for bit in bf16 too (the adapters add exact zeros), so every
    reward is 0 and the loss is log 2 plus RPO's term, whose chosen cross-entropy is a mean
    of bf16 logits' losses: within sqrt(20 L + 2) u_bf16 of the logits' scale (the rounding
    along the depth, tests/test_bf16.py's `_step1_bound` without its averaging credit) of
    fp32's. After it, bf16 rounding only: the figures as fp32's to a few percent."""
    u_bf16, depth, scale = 2.0**-8, 4, 0.02 * 64**0.5  # the tiny model: 4 layers, 64 wide
    nll_bound = (20 * depth + 2) ** 0.5 * u_bf16 * scale
    first, theirs = records[0], fp32[0]
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert first["rewards/accuracy"] == 0.0 and first["pairs"] == theirs["pairs"]
    assert first["loss"] - 0.3 * first["nll"] == pytest.approx(0.6931471805599453, abs=1e-12)
    assert abs(first["nll"] - theirs["nll"]) <= nll_bound
    # Then bf16 rounding through 3 steps, against multiples of u_bf16 (measured on an AVX2
    # EPYC: loss 0.15%, grad norm 0.8%, margins 0.5%, accuracy equal): a loss within 4u, the
    # norm within 8u, the margins (a difference of two rewards) within 16u of their size,
    # at most one pair of 8 ranked otherwise.
    for step, (ours, theirs) in enumerate(zip(records, fp32, strict=True), start=1):
        where = f"bf16 step {step}"
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=4 * u_bf16), where
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=8 * u_bf16), where
        margin = ours["rewards/chosen"] - ours["rewards/rejected"]
        expected = theirs["rewards/chosen"] - theirs["rewards/rejected"]
        assert margin == pytest.approx(expected, rel=16 * u_bf16, abs=1e-12), where
        assert abs(ours["rewards/accuracy"] - theirs["rewards/accuracy"]) <= 1 / 8, where


def test_a_resume_keeps_its_objective_and_a_dpo_stage_starts_from_no_adapters():
    from moetrain.checkpoint.continuation import Continuation, check_stage_objective
    from moetrain.checkpoint.resume import accept_objective

    cfg = load_config(DPO)
    with pytest.raises(DataError, match="was trained with train.objective=sft"):
        accept_objective("run/step-4", {"config": {"train": {"objective": "sft"}}}, cfg)
    accept_objective("run/step-4", {"config": {"train": {"objective": "dpo"}}}, cfg)
    lora_stage = Continuation("sft/step-9", {"config": {"peft": {"method": "lora"}}}, [])
    with pytest.raises(ConfigError, match="sft/step-9 holds LoRA adapters"):
        check_stage_objective(lora_stage, cfg)
    check_stage_objective(Continuation("sft/step-9", {"config": {"peft": {}}}, []), cfg)


def test_held_out_pairs_report_the_training_figures(pairs_run):
    """The evaluation of held-out pairs (eval.fraction of a preference corpus) against the
    independent sums of tests/dpo_parity.py, with a base model as the reference."""
    import torch.distributed as dist

    from moetrain.data.conversations import PackedConversations
    from moetrain.data.prepared import PreparedCorpus
    from moetrain.data.run_data import HeldOut
    from moetrain.data.tokenizers import build_tokenizer
    from moetrain.loop.evaluation import Evaluator
    from tests.dpo_parity import held_out_reference

    argv = [
        *BASE,
        "--peft.method=lora",
        "--peft.rank=4",
        "--train.objective=dpo",
        "--data.source=tokens",
        f"--data.path={pairs_run / 'pairs'}",
        f"--data.tokenizer={pairs_run / 'model'}",
        "--data.seq_len=320",
        "--dpo.beta=0.3",
        "--dpo.nll_weight=0.5",
    ]
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    base = spec.build(cfg.model.args)
    base.init_weights(0)
    model = spec.build(cfg.model.args)
    apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
    model.init_weights(0)
    init_adapters(model, 0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.2)
    corpus = PreparedCorpus.open(cfg.data.path)
    eos = build_tokenizer(cfg.data).eos_id
    held = PackedConversations(corpus, 320, eos, True, holdout=0.3, evaluation=True)
    terms = spec.loss_terms(cfg.model.args)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        evaluator = Evaluator(
            [HeldOut("held_out", held, 3)], 2, 0, 1, lambda b: b, terms, True, cfg.dpo
        )
        record = evaluator(model)
    finally:
        dist.destroy_process_group()
    expected = held_out_reference(model, base, held, 3, 0.3, 0.5)  # eval.samples of them
    assert record["eval_pairs"] == expected["eval_pairs"] > 0
    for key in ("eval_loss", "eval_nll", "eval_rewards/chosen", "eval_rewards/rejected"):
        assert record[key] == pytest.approx(expected[key], rel=1e-5, abs=3e-5), key
