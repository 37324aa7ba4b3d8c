"""`dpo.reference=stored` (full fine-tuning's DPO reference, moetrain/loop/stored_reference.py)
as a run uses it: a fresh run's first pass, training against it equal to a plain process
whose reference is a separately built frozen copy of the initial model, and a resume that
reads the stored table (never one computed from the trained weights) and is refused when
the file, the data or the initial model is not the run's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moetrain.checkpoint.markers import read_trainer_state
from moetrain.checkpoint.reference_file import read_reference
from moetrain.config import load_config
from moetrain.errors import CheckpointError, DataError
from moetrain.loop.preflight import preflight
from moetrain.parallelisms.dims import ParallelDims
from tests.chat_model import save_chat_model
from tests.dpo_parity import FIGURES, dpo_reference_run
from tests.parity import TINY, build_trainer
from tests.test_preference_prepare import preference_pairs, prepare_pairs

STEPS = 4
HELD_SAMPLES = 2


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_stored")
    save_chat_model(root / "model")
    prepare_pairs(preference_pairs(40), root / "model", root / "pairs")
    held = preference_pairs(48)[40:]  # other prompts than the training pairs'
    prepare_pairs(held, root / "model", root / "held")
    return root


def _argv(root, out) -> list[str]:
    tiny = [a for a in TINY if not a.startswith(("--data.seq_len", "--data.max_tokens"))]
    return [
        *tiny,
        "--data.source=tokens",
        f"--data.path={root / 'pairs'}",
        f"--data.tokenizer={root / 'model'}",
        "--data.seq_len=320",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--train.objective=dpo",  # peft.method=none: dpo.reference=auto is stored
        "--dpo.beta=0.5",
        "--moe.z_loss_coef=0.05",
        "--train.lr=3e-3",
        f"--train.steps={STEPS}",
        "--checkpoint.interval=2",
        f"--eval.path={root / 'held'}",  # evaluated at the end, its reference stored too
        f"--eval.samples={HELD_SAMPLES}",
        f"--job.output_dir={out}",
    ]


def _trained(argv: list[str]):
    """(notes, history, final parameters, stored table, the table the final weights would
    give) of a one-rank run of `argv` (the tables: None under dpo.reference=copy)."""
    from moetrain.loop.preference import ModelLogps, Reference
    from moetrain.loop.stored_reference import StoredReference, first_pass

    _, trainer = build_trainer(argv, 1)
    try:
        table = trainer.reference.table if isinstance(trainer.reference, StoredReference) else None
        history = trainer.fit()
        params = {
            n: (q.full_tensor() if isinstance(q, DTensor) else q).detach().clone()
            for n, q in trainer.model.named_parameters()
        }
        if table is None:
            return trainer.notes, history, params, None, None
        reference = Reference(ModelLogps(trainer.model, trainer.terms, True))
        after = first_pass(reference, trainer.batches.pair_batches()).sums
        return trainer.notes, history, params, (table.keys.clone(), table.sums.clone()), after
    finally:
        dist.destroy_process_group()


def _held_out_loss(argv: list[str], trained: dict) -> tuple[float, int]:
    """The DPO loss of the held-out pairs (their first eval.samples samples) for the policy
    with `trained` weights against a frozen copy of the initial model, computed apart
    (tests/dpo_parity.py's sums), and their count."""
    from moetrain.data.conversations import PackedConversations
    from moetrain.data.prepared import PreparedCorpus
    from moetrain.data.tokenizers import build_tokenizer
    from moetrain.models import get_model_spec
    from tests.dpo_parity import _logps, _pairs, _side_sums

    cfg = load_config(argv)
    spec, beta = get_model_spec(cfg.model.name), cfg.dpo.beta
    policy, base = spec.build(cfg.model.args), spec.build(cfg.model.args)
    base.init_weights(cfg.train.seed)
    policy.load_state_dict(trained)
    eos = build_tokenizer(cfg.data).eos_id
    held = PackedConversations(PreparedCorpus.open(cfg.eval.path), cfg.data.seq_len, eos, True)
    loss, count = 0.0, 0
    with torch.no_grad():
        for i in range(cfg.eval.samples):
            sample = held[i].map(lambda t: t[None])
            theirs = _side_sums(_logps(policy, sample)[0], sample)
            reference = _side_sums(_logps(base, sample)[0], sample)
            for pc, pr, rc, rr, _ in _pairs(theirs, reference):
                margin = torch.tensor(beta * float((pc - rc) - (pr - rr)))
                loss, count = loss - float(torch.nn.functional.logsigmoid(margin)), count + 1
    return loss / count, count


def _refused(argv: list[str], error: type[Exception]) -> str:
    with pytest.raises(error) as info:
        try:
            build_trainer(argv, 1)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return str(info.value)


def test_full_fine_tuning_trains_against_the_stored_first_pass_and_resumes_on_it(pairs, tmp_path):
    """One rank, 4 steps: every figure and the final weights within 1e-5 of the plain
    process's, whose reference is a frozen copy run on the fly; a resume from step 2 reads
    the stored table bit for bit and trains steps 3-4 as the uninterrupted run did."""
    run = tmp_path / "run"
    argv = _argv(pairs, run)
    notes, history, params, table, trained_sums = _trained(argv)
    assert any("dpo.reference=stored: the initial model's" in n for n in notes), notes
    assert (run / "dpo_reference.safetensors").is_file()
    ref = dpo_reference_run(argv, STEPS)
    assert ref[0]["loss"] == pytest.approx(0.6931471805599453)  # the policy is its reference
    assert ref[-1]["rewards/accuracy"] > 0 and ref[-1]["pairs"] >= 8
    for step, (ours, theirs) in enumerate(zip(history, ref, strict=True), start=1):
        for key in FIGURES:
            tol = 3e-5 if key.startswith("rewards/") else 1e-7  # as the layouts' test
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=tol), f"{step} {key}"
    for name, value in params.items():
        torch.testing.assert_close(value, ref[-1]["params"][name], rtol=1e-5, atol=1e-5)
    worst = max((params[n] - ref[-1]["params"][n]).abs().max().item() for n in params)
    losses = max(abs(a["loss"] - b["loss"]) for a, b in zip(history, ref, strict=True))
    print(f"stored vs frozen copy: max |loss diff| {losses:.2e}, max |param diff| {worst:.2e}")
    loss, pairs_seen = _held_out_loss(argv, ref[-1]["params"])
    assert history[-1]["eval_pairs"] == pairs_seen > 0
    assert history[-1]["eval_loss"] == pytest.approx(loss, rel=1e-5)

    # The relaunch after step 2 (its step-4 checkpoint lost): the table as stored.
    again = tmp_path / "again"
    shutil.copytree(run, again, ignore=shutil.ignore_patterns("step-4", "metrics.jsonl"))
    relaunch = [*argv[:-1], f"--job.output_dir={again}"]
    notes, resumed, resumed_params, resumed_table, _ = _trained(relaunch)
    assert any("as " in n and "step-2 records it" in n for n in notes), notes
    # The first pass's table, bit for bit: not one of the trained weights (which moved
    # each side's sum).
    assert all(torch.equal(a, b) for a, b in zip(resumed_table, table, strict=True))
    assert (trained_sums - table[1]).abs().min() > 1e-3
    assert [r["step"] for r in resumed] == [3, 4]
    assert resumed[-1]["eval_loss"] == pytest.approx(history[-1]["eval_loss"], rel=1e-6)
    for ours, theirs in zip(resumed, history[2:], strict=True):
        for key in FIGURES:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), key
    for name, value in resumed_params.items():
        torch.testing.assert_close(value, params[name], rtol=1e-6, atol=1e-7)

    # Refused: other data, another initial model, a changed or missing file.
    (again / "checkpoints" / "step-4").rename(again / "step-4")  # resume from step 2
    other_data = [*relaunch, "--data.max_tokens=30000", "--checkpoint.allow_data_change=true"]
    assert "covers other data than this run's" in _refused(other_data, CheckpointError)
    # (another train.seed is refused by the sampler first) another model.init_from_hf:
    step2 = str(again / "checkpoints" / "step-2")
    record = read_trainer_state(step2)["dpo_reference"]
    other_init = load_config([*relaunch, f"--model.init_from_hf={pairs / 'model'}"])
    with pytest.raises(CheckpointError, match="another initial model than this config names"):
        read_reference(step2, record, other_init, record["data"])
    stored = again / "dpo_reference.safetensors"
    data = bytearray(stored.read_bytes())
    data[-1] ^= 1
    stored.write_bytes(bytes(data))
    assert "changed since (sha256 differs)" in _refused(relaunch, CheckpointError)
    cfg = load_config(relaunch)  # refused before any process group or weight: by preflight
    with pytest.raises(CheckpointError, match="changed since"):
        preflight(cfg, ParallelDims.of(cfg.parallel, 1))
    stored.unlink()
    assert "is gone" in _refused(relaunch, CheckpointError)


def test_the_reference_copy_trains_as_the_frozen_copy_and_resumes_on_the_initial_weights(
    pairs, tmp_path
):
    """dpo.reference=copy on one rank: 4 steps within 1e-5 of the plain process (its
    reference a separately built frozen copy), and a resume from step 2 reloads the copy
    from the initial weights (not the checkpoint's trained ones): steps 3-4 as uninterrupted."""
    run = tmp_path / "run"
    argv = [*_argv(pairs, run), "--dpo.reference=copy"]
    notes, history, params, _, _ = _trained(argv)
    assert any(n.startswith("dpo.reference=copy: a frozen copy of the initial") for n in notes)
    ref = dpo_reference_run(argv, STEPS)
    for step, (ours, theirs) in enumerate(zip(history, ref, strict=True), start=1):
        for key in FIGURES:
            tol = 3e-5 if key.startswith("rewards/") else 1e-7
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=tol), f"{step} {key}"
    for name, value in params.items():
        torch.testing.assert_close(value, ref[-1]["params"][name], rtol=1e-5, atol=1e-5)
    assert history[-1]["eval_loss"] == pytest.approx(
        _held_out_loss(argv, ref[-1]["params"])[0], rel=1e-5
    )
    again = tmp_path / "again"
    shutil.copytree(run, again, ignore=shutil.ignore_patterns("step-4", "metrics.jsonl"))
    relaunch = [*argv, f"--job.output_dir={again}"]
    notes, resumed, resumed_params, _, _ = _trained(relaunch)
    assert any("the initial model reloaded from train.seed=" in n for n in notes), notes
    for ours, theirs in zip(resumed, history[2:], strict=True):
        for key in FIGURES:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), key
    for name, value in resumed_params.items():
        torch.testing.assert_close(value, params[name], rtol=1e-6, atol=1e-7)
    stored = [
        *relaunch,
        "--dpo.reference=stored",
        "--checkpoint.resume=" + str(again / "checkpoints" / "step-2"),
    ]
    assert "records no stored DPO reference" in _refused(stored, CheckpointError)


def test_a_document_the_table_lacks_is_nan_and_refused_with_the_step():
    from moetrain.data.batch import Batch
    from moetrain.loop.stored_reference import ReferenceTable, document_keys, refuse_missing
    from tests.test_host_reads import HostReads

    ids = torch.tensor([[5, 6, 7, 8, 9, 3]])
    labels = torch.tensor([[-100, 7, -100, 9, 3, -100]])
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    positions = torch.tensor([[0, 1, 0, 1, 2, 0]])
    batch = Batch(ids, labels, positions, docs)
    keys = document_keys(batch)[0]
    # The same document elsewhere in a sample (after another): the same key.
    moved = Batch(ids[:, 2:5], labels[:, 2:5], positions[:, 2:5], torch.zeros(1, 3).long())
    assert document_keys(moved)[0, 0] == keys[1]
    table = ReferenceTable(keys[1:2], torch.tensor([-2.5], dtype=torch.float64))
    with HostReads() as seen:  # a step's lookups read nothing into Python
        got = table(batch)[0]
    assert seen.reads == []
    assert got[0].isnan() and got[1] == -2.5 and (got[2:] == 0).all()  # doc 2: no labels
    edited = Batch(ids, labels.where(labels != 9, 8), positions, docs)  # one label changed
    assert table(edited)[0, 1].isnan()
    record = {"reference_missing": torch.tensor(1.0).item()}
    with pytest.raises(DataError, match="step 3: 1 sides of the pairs are not in the stored"):
        refuse_missing(record, 3)
    quiet = {"reference_missing": 0.0, "loss": 1.0}
    refuse_missing(quiet, 3)
    assert quiet == {"loss": 1.0}


def test_the_planner_counts_the_reference_copy(pairs, tmp_path):
    """dpo.reference=copy holds a second, frozen set of every parameter shard beside the
    policy: the plan's peak rises by the parameters' bytes (and the copy's sums held per
    micro-batch), the policy's parameters, gradients and optimizer state unchanged; through
    the planner's command line on real prepared pairs (tests/test_planner_objective.py has
    the per-term counts)."""
    from moetrain.planner.cli import main
    from tests.test_dry_run import CONFIG

    dpo = ["--train.objective=dpo", "--data.source=tokens", f"--data.path={pairs / 'pairs'}"]
    dpo += [f"--data.tokenizer={pairs / 'model'}", "--data.seq_len=320"]
    plans = {}
    for reference in ("stored", "copy"):
        out = tmp_path / f"{reference}.json"
        argv = ["--world-size=1", "--config", CONFIG, *dpo, f"--dpo.reference={reference}"]
        assert main([*argv, f"--json={out}"]) == 0
        plans[reference] = json.loads(out.read_text())
    stored, copy = (plans[k]["per_rank"][0] for k in ("stored", "copy"))
    for key in ("params", "frozen", "optimizer", "grads"):
        assert copy[key] == stored[key]
    assert plans["copy"]["objective"]["resting_bytes"] == [stored["params"]]
    table = plans["stored"]["objective"]["resting_bytes"][0]
    held = plans["copy"]["objective"]["held_bytes"]
    assert plans["copy"]["peak"] - plans["stored"]["peak"] == stored["params"] + held - table


def test_a_copy_resume_checks_the_weights_it_reloads(pairs, tmp_path):
    """The record a copy's resume reloads from: refused when the weights at its path changed
    since the run started (content fingerprint) or are gone, or the config names others."""
    from moetrain.checkpoint.frozen_base import hf_fingerprint
    from moetrain.checkpoint.reference_file import check_recorded, initial_model

    model = tmp_path / "model"
    shutil.copytree(pairs / "model", model)
    argv = [*_argv(pairs, tmp_path / "run"), "--dpo.reference=copy"]
    cfg = load_config([*argv, f"--model.init_from_hf={model}"])
    base = {"source": "hf", "path": str(model), "fingerprint": hf_fingerprint(str(model))}
    record = {"kind": "copy", "initial": initial_model(cfg), "base": base}
    assert check_recorded("run/step-2", record, cfg)["base"] == base
    other = load_config([*argv, f"--model.init_from_hf={pairs / 'model'}"])
    with pytest.raises(CheckpointError, match="another initial model than this config"):
        check_recorded("run/step-2", record, other)
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="its weights changed since"):
        check_recorded("run/step-2", record, cfg)
    shutil.rmtree(model)
    with pytest.raises(CheckpointError, match="and it is gone"):
        check_recorded("run/step-2", record, cfg)
