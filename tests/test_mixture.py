"""[[data.mix]]: prepared corpora blended by weight (moetrain/data/mixture.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from moetrain import train
from moetrain.config import DataSection, MixSource, load_config, startup_notes
from moetrain.data.mixture import BlendedOrder, interleave, weight_changes
from moetrain.data.run_data import build_data
from moetrain.data.sampler import GlobalBatchSampler
from moetrain.data.tokenizers import ByteTokenizer
from moetrain.errors import DataError
from moetrain.prepare.cli import main as prepare
from tests.distributed import ROOT, finish, launch_train, read_metrics, run_train
from tests.test_tokens_source import write_jsonl

WEIGHTS = {
    "two": [0.7, 0.3],
    "skewed": [0.98, 0.01, 0.01],
    "thirds": [1.0, 1.0, 1.0],
    "seven": [random.Random(3).random() for _ in range(7)],
}


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_counts_stay_within_one_sample_of_the_weights(name):
    weights = [w / sum(WEIGHTS[name]) for w in WEIGHTS[name]]
    counts = [0] * len(weights)
    for n in range(1, 10_001):
        interleave(weights, counts, n - 1, 1)
        assert max(abs(c - w * n) for c, w in zip(counts, weights, strict=True)) < 1, n


def _order(weights, sizes=(50, 7, 13), batch=12, seed=0) -> BlendedOrder:
    keys = [f"s{i}" for i in range(len(sizes))]
    return BlendedOrder(keys, list(sizes), list(weights), batch, seed, True)


def _global_order(dp: int, micro: int, steps: int, order: BlendedOrder, start=None) -> list:
    """Each step's global batch, read through dp samplers (rank slices concatenated)."""
    samplers = [
        GlobalBatchSampler(sum(order.sizes), 12, micro, r, dp, 0, True, blend=order)
        for r in range(dp)
    ]
    if start is not None:
        for s in samplers:
            s.load_state_dict(start)
    out = []
    for _ in range(steps):
        step = []
        for s in samplers:
            for _ in range(s.grad_accum):
                step += s.next_micro_batch()
        out.append(step)
    return out


def test_the_global_order_is_the_same_on_1_2_and_4_ranks():
    reference = _global_order(1, 2, 30, _order([0.5, 0.3, 0.2]))
    for dp, micro in ((2, 3), (4, 1), (4, 3)):
        assert _global_order(dp, micro, 30, _order([0.5, 0.3, 0.2])) == reference
    # Each source walks its own epochs: source 1 (7 samples) is seen whole every 7 draws.
    order = _order([0.5, 0.3, 0.2])
    flat = [i for step in reference for i in step]
    small = [i - order.offsets[1] for i in flat if order.offsets[1] <= i < order.offsets[2]]
    assert len(small) >= 14
    for epoch in range(len(small) // 7):
        assert sorted(small[7 * epoch : 7 * epoch + 7]) == list(range(7))
    assert small[:7] != small[7:14]  # another shuffle in the next epoch


def test_the_blend_resumes_on_another_layout_and_keeps_o_of_sources_state():
    order = _order([0.5, 0.3, 0.2])
    sampler = GlobalBatchSampler(70, 12, 2, 0, 1, 0, True, blend=order)
    whole = _global_order(1, 2, 40, _order([0.5, 0.3, 0.2]))
    for _ in range(17 * 6):  # 17 steps of 6 micro-batches
        sampler.next_micro_batch()
    state = json.loads(json.dumps(sampler.state_at(17 * 12)))  # as a checkpoint keeps it
    assert set(state["blend"]["counts"]) == {"s0", "s1", "s2"}
    resumed = _global_order(4, 1, 23, _order([0.5, 0.3, 0.2]), start=state)
    assert resumed == whole[17:]
    assert len(order._counts) <= 64 and len(order._steps) <= 5  # no per-sample table


def test_a_changed_blend_continues_each_source_where_it_was():
    old = GlobalBatchSampler(70, 12, 12, 0, 1, 0, True, blend=_order([0.5, 0.3, 0.2]))
    for _ in range(10):
        old.next_micro_batch()
    state = old.state_at(120)
    new_order = _order([0.2, 0.3, 0.5])
    new = GlobalBatchSampler(70, 12, 12, 0, 1, 0, True, blend=new_order)
    new.continue_on_other_data(state)
    assert new.consumed_samples == 120 and new_order.origin == 120
    assert new_order.base == [old.blend.cursors_at(120)[i] for i in range(3)]
    steps = [new.next_micro_batch() for _ in range(50)]
    counts = [
        sum(new_order.offsets[s] <= i < new_order.offsets[s + 1] for b in steps for i in b)
        for s in range(3)
    ]
    assert [abs(c - w * 600) < 1 for c, w in zip(counts, [0.2, 0.3, 0.5], strict=True)] == [
        True
    ] * 3


def test_a_changed_blend_resumed_as_the_same_is_refused_naming_each_weight():
    # A checkpoint without a data identity reaches the same-blend path: its weights decide.
    old = GlobalBatchSampler(70, 12, 12, 0, 1, 0, True, blend=_order([0.5, 0.3, 0.2]))
    old.next_micro_batch()
    state = json.loads(json.dumps(old.state_at(12)))
    new = GlobalBatchSampler(70, 12, 12, 0, 1, 0, True, blend=_order([0.5, 0.2, 0.3]))
    with pytest.raises(DataError) as info:
        new.load_state_dict(state)
    message = str(info.value)
    assert "s1: weight 0.3 -> 0.2" in message and "s2: weight 0.2 -> 0.3" in message
    assert "s0" not in message and "allow_data_change" in message
    # As many digits as tell two weights apart; sources added and removed by name.
    assert weight_changes({"a": 0.1, "b": 0.9}, {"a": 0.1 + 1e-12, "c": 0.9}) == [
        "a: weight 0.1 -> 0.100000000001",
        "b: removed (weight was 0.9)",
        "c: added (weight 0.9)",
    ]


def test_a_weight_that_gives_no_sample_in_the_run_is_noted():
    tables = "[{path='web', weight=1}, {path='code', weight=1e-300, name='rare'}]"
    argv = ["--data.source=tokens", "--train.steps=10", "--train.global_batch_size=8"]
    notes = startup_notes(load_config([*argv, f"--data.mix={tables}"]))
    assert len(notes) == 1 and notes[0].startswith("data.mix[2] (rare) has weight 1e-300")
    assert "of the run's 80 samples" in notes[0]
    # A share of 0.79 samples is noted, one of 1.57 is not.
    assert startup_notes(load_config([*argv, f"--data.mix={tables.replace('1e-300', '0.01')}"]))
    assert not startup_notes(load_config([*argv, f"--data.mix={tables.replace('1e-300', '0.02')}"]))


# --- through train.py ---------------------------------------------------------------------

DEBUG = "--config=configs/debug_qwen3_moe.toml"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    return prepare_corpora(tmp_path_factory.mktemp("mix"))


def prepare_corpora(root: Path) -> dict[str, Path]:
    """Three small prepared corpora under `root` (web, code, math) -> their directories."""
    rng = random.Random(0)
    vocab = {"web": "the cat sat on a mat", "code": "def f ( x ) : return x", "math": "1 + 2 = 3"}
    out = {}
    for name, words in vocab.items():
        docs = [
            " ".join(rng.choice(words.split()) for _ in range(rng.randint(20, 150)))
            for _ in range(150)
        ]
        write_jsonl(root / name / "c.jsonl", docs)
        out[name] = root / f"{name}-tok"
        assert (
            prepare(
                [
                    "--source",
                    "jsonl",
                    "--path",
                    str(root / name / "c.jsonl"),
                    "--out",
                    str(out[name]),
                    "--workers",
                    "1",
                ]
            )
            == 0
        )
    return out


def _mix(corpora, weights: dict[str, float]) -> str:
    tables = ", ".join(
        f"{{path='{corpora[n]}', weight={w}, name='{n}'}}" for n, w in weights.items()
    )
    return f"--data.mix=[{tables}]"


BLEND = {"web": 0.5, "code": 0.3, "math": 0.2}


def _run(corpora, weights=BLEND) -> list[str]:
    return [
        DEBUG,
        "--data.source=tokens",
        "--data.max_tokens=none",
        "--data.seq_len=64",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--metrics.log_interval=1",
        # The same LR at every step whatever train.steps: runs cut short compare with one.
        "--train.schedule=constant",
        "--train.warmup_steps=1",
        _mix(corpora, weights),
    ]


def _refused(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err, err
    return err


def test_bad_blends_are_refused_before_anything_starts(corpora, tmp_path, capsys, monkeypatch):
    run = _run(corpora)
    err = _refused([*run[:-1], _mix(corpora, {"web": 0.5, "code": 0})], capsys, monkeypatch)
    assert "data.mix[2].weight must be > 0, got 0.0" in err
    err = _refused([*run[:-1], "--data.mix=[{path='x', weight=inf}]"], capsys, monkeypatch)
    assert "data.mix[1]: weight: expected float, got inf" in err
    err = _refused([*run, f"--data.path={corpora['web']}"], capsys, monkeypatch)
    assert "data.path and [[data.mix]] are both set" in err
    err = _refused([*run, "--data.source=jsonl"], capsys, monkeypatch)
    assert "data.source = 'tokens'" in err
    missing = tmp_path / "nothing"
    err = _refused([*run[:-1], f"--data.mix=[{{path='{missing}', weight=1}}]"], capsys, monkeypatch)
    assert f"data.mix[1].path='{missing}' does not exist" in err and "moetrain.prepare" in err
    # Each table is named by its own key, held-out ones too.
    web = f"{{path='{corpora['web']}', weight=1}}"
    err = _refused(
        [*run[:-1], f"--data.mix=[{web}, {{path='{missing}', weight=1}}]"], capsys, monkeypatch
    )
    assert f"data.mix[2].path='{missing}' does not exist" in err
    err = _refused(
        [*run, f"--eval.mix=[{web}, {{path='{missing}', weight=1}}]"], capsys, monkeypatch
    )
    assert f"eval.mix[2].path='{missing}' does not exist" in err
    # A held-out source its weight gives no sample would have no tokens to take a loss over.
    rare = _mix(corpora, {"web": 1, "code": 1e-300}).replace("--data.mix", "--eval.mix")
    err = _refused([*run, rare], capsys, monkeypatch)
    assert "eval.mix[2] (code) gets none of the eval.samples=64" in err
    damaged = tmp_path / "damaged"
    shutil.copytree(corpora["web"], damaged)
    (damaged / "manifest.json").write_text('{"format": "moetrain-tokens/2", "shards": [')
    err = _refused([*run[:-1], f"--data.mix=[{{path='{damaged}', weight=1}}]"], capsys, monkeypatch)
    assert "manifest.json is not a valid manifest" in err
    tiny = tmp_path / "tiny"
    write_jsonl(tmp_path / "t" / "c.jsonl", ["hi"])
    assert (
        prepare(
            ["--source", "jsonl", "--path", str(tmp_path / "t" / "c.jsonl"), "--out", str(tiny)]
        )
        == 0
    )
    err = _refused([*run[:-1], f"--data.mix=[{{path='{tiny}', weight=1}}]"], capsys, monkeypatch)
    assert "not one sample of data.seq_len=64" in err
    from tests.test_data import _save_tiny_hf_tokenizer

    tok = _save_tiny_hf_tokenizer(tmp_path / "tok.json", ["</s>"])
    other = tmp_path / "other-tok"
    assert (
        prepare(
            [
                "--source",
                "jsonl",
                "--path",
                str(tmp_path / "t" / "c.jsonl"),
                "--tokenizer",
                str(tok),
                "--out",
                str(other),
            ]
        )
        == 0
    )
    err = _refused(
        [*run[:-1], _mix({**corpora, "x": other}, {"web": 1, "x": 1})], capsys, monkeypatch
    )
    assert "was prepared with tokenizer tokenizer.json" in err


def test_the_blend_s_description_shows_each_weight_so_changed_weights_differ(corpora):
    def source(weights: dict[str, float]) -> str:
        tables = [MixSource(str(corpora[n]), w, n) for n, w in weights.items()]
        cfg = DataSection(source="tokens", mix=tables, seq_len=64)
        return build_data(cfg, None, ByteTokenizer()).train.summary.source

    assert source(BLEND) == "blend of 3 prepared corpora (weights: web 0.5, code 0.3, math 0.2)"
    # A change the console's usual 3 decimals would hide still reads differently.
    assert source({**BLEND, "web": 0.5 + 1e-9}) != source(BLEND)


@pytest.mark.slow
def test_a_blend_resumes_on_another_layout_and_a_changed_weight_is_refused(corpora, tmp_path):
    out = tmp_path / "run"
    whole = run_train([*_run(corpora), "--train.steps=4"], tmp_path / "whole")
    assert all(
        r["tokens/web"] + r["tokens/code"] + r["tokens/math"] == r["step"] * 8 * 64 for r in whole
    )
    assert [abs(r["tokens/code"] / 64 - 0.3 * 8 * r["step"]) < 1 for r in whole] == [True] * 4
    run_train([*_run(corpora), "--train.steps=2", "--checkpoint.interval=2"], out)
    resumed = run_train(
        [*_run(corpora), "--train.steps=4", "--parallel.ep=2", "--checkpoint.interval=2"],
        out,
        nproc=2,
    )
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for ours, ref in zip(resumed[2:], whole[2:], strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert ours["data_fingerprint"] == ref["data_fingerprint"]  # the same samples
    changed = [*_run(corpora, {"web": 0.6, "code": 0.2, "math": 0.2}), "--train.steps=6"]
    log = tmp_path / "run.log"
    proc = launch_train(changed, out)
    text = finish(proc, out)
    assert proc.returncode == 2 and "other data" in text and "allow_data_change" in text, text[
        -2000:
    ]
    assert "(weights: web 0.5, code 0.3, math 0.2)" in text  # what changed, both sides
    assert "(weights: web 0.6, code 0.2, math 0.2)" in text
    records = run_train([*changed, "--checkpoint.allow_data_change=true"], out)
    assert "resuming on other data" in log.read_text()
    assert [r["step"] for r in records][-2:] == [5, 6]
    # From step 4 on the new weights apply to the samples drawn since.
    since = {n: records[-1][f"tokens/{n}"] - records[3][f"tokens/{n}"] for n in ("web", "code")}
    assert abs(since["web"] / 64 - 0.6 * 16) < 1 and abs(since["code"] / 64 - 0.2 * 16) < 1
    assert read_metrics(out)[-1]["step"] == 6
