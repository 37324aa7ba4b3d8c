"""`prepare --format preference` as a user runs it: TRL's conversational pairs (explicit
prompt, or whole conversations sharing it) from JSON lines and dataset rows, each side
rendered as `--format chat` renders a last answer, the two sides adjacent; pairs that do
not fit `--truncate` left out whole; bad pairs refused by file:line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrain.data.conversations import PackedConversations
from moetrain.data.prepared import PreparedCorpus
from moetrain.prepare.cli import main as prepare
from tests.chat_model import CHATML, conversations, save_chat_tokenizer

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


def preference_pairs(count: int) -> list[dict]:
    """Pairs from the test conversations: the prompt is each conversation up to its last
    answer, chosen that answer, rejected another conversation's last answer."""
    convs = conversations()
    pairs = []
    for i in range(count):
        conv, other = convs[i], convs[(i + 7) % len(convs)]
        pairs.append({"prompt": conv[:-1], "chosen": conv[-1:], "rejected": [dict(other[-1])]})
    return pairs


def prepare_pairs(pairs: list[dict], tokenizer, out) -> None:
    """`pairs` written as JSON lines beside `out` and prepared into `out` with the tokenizer
    (a model directory) as a user runs it, on one worker."""
    source = out.parent / f"{out.name}.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    argv = ["--source", "jsonl", "--format", "preference", "--path", str(source)]
    argv += ["--tokenizer", str(tokenizer), "--workers", "1", "--out", str(out)]
    assert prepare(argv) == 0


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    save_chat_tokenizer(root / "tok", CHATML)
    return root / "tok"


def _prepare(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = prepare([*argv, "--workers", "1"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _documents(path) -> list[tuple[np.ndarray, np.ndarray]]:
    corpus = PreparedCorpus.open(str(path))
    tokens, mask, ends = corpus.tokens()[:], corpus.masks()[:], corpus.document_ends()
    starts = np.concatenate([[0], ends[:-1]])
    return [(tokens[a:b], mask[a:b]) for a, b in zip(starts, ends, strict=True)]


def _write(path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_each_side_is_chat_s_last_answer_and_the_two_layouts_agree(tokenizer_dir, capsys, tmp_path):
    pairs = preference_pairs(6)
    base = ["--source", "jsonl", "--tokenizer", str(tokenizer_dir)]
    _write(tmp_path / "explicit.jsonl", pairs)
    code, out, err = _prepare(
        [
            *base,
            "--format",
            "preference",
            "--path",
            str(tmp_path / "explicit.jsonl"),
            "--out",
            str(tmp_path / "explicit"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "prepared 12 documents (6 pairs)" in out
    assert PreparedCorpus.open(str(tmp_path / "explicit")).manifest.preference
    # Whole conversations that share the prompt (TRL's implicit prompt): the same bytes.
    implicit = [
        {"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]}
        for p in pairs
    ]
    _write(tmp_path / "implicit.jsonl", implicit)
    code, _, err = _prepare(
        [
            *base,
            "--format",
            "preference",
            "--path",
            str(tmp_path / "implicit.jsonl"),
            "--out",
            str(tmp_path / "implicit"),
        ],
        capsys,
    )
    assert code == 0, err
    # Each side: what `--format chat --chat-turns last` trains of the prompt and that answer.
    sides = [{"messages": p["prompt"] + p[side]} for p in pairs for side in ("chosen", "rejected")]
    _write(tmp_path / "sides.jsonl", sides)
    code, _, err = _prepare(
        [
            *base,
            "--format",
            "chat",
            "--chat-turns",
            "last",
            "--path",
            str(tmp_path / "sides.jsonl"),
            "--out",
            str(tmp_path / "sides"),
        ],
        capsys,
    )
    assert code == 0, err
    explicit, chat = _documents(tmp_path / "explicit"), _documents(tmp_path / "sides")
    assert len(explicit) == 12
    for (ids, mask), (chat_ids, chat_mask) in zip(explicit, chat, strict=True):
        assert np.array_equal(ids, chat_ids) and np.array_equal(mask, chat_mask)
        assert mask[: int(np.argmax(mask))].sum() == 0 and mask.sum() > 0
    for (a, b), (c, d) in zip(explicit, _documents(tmp_path / "implicit"), strict=True):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    for k in range(6):  # the two sides of a pair: the same prompt tokens, then their answers
        (chosen, cm), (rejected, rm) = explicit[2 * k], explicit[2 * k + 1]
        start = int(np.argmax(cm))
        assert start == int(np.argmax(rm)) and np.array_equal(chosen[:start], rejected[:start])
        assert not np.array_equal(chosen, rejected)


def test_pairs_from_dataset_rows_and_truncate_leaves_out_whole_pairs(
    tokenizer_dir, capsys, tmp_path
):
    datasets = pytest.importorskip("datasets", reason="needs the [hf] extra (datasets)")
    pairs = preference_pairs(5)
    _write(tmp_path / "p.jsonl", pairs)
    base = ["--format", "preference", "--tokenizer", str(tokenizer_dir)]
    assert (
        _prepare(
            [
                *base,
                "--source",
                "jsonl",
                "--path",
                str(tmp_path / "p.jsonl"),
                "--out",
                str(tmp_path / "lines"),
            ],
            capsys,
        )[0]
        == 0
    )
    datasets.Dataset.from_list(pairs).save_to_disk(str(tmp_path / "rows"))
    code, _, err = _prepare(
        [
            *base,
            "--source",
            "hf_datasets",
            "--path",
            str(tmp_path / "rows"),
            "--out",
            str(tmp_path / "rows_out"),
        ],
        capsys,
    )
    assert code == 0, err
    lines = _documents(tmp_path / "lines")
    for (a, b), (c, d) in zip(lines, _documents(tmp_path / "rows_out"), strict=True):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    # A pair takes one sample: both sides, each with its EOS, in SEQ_LEN + 1 tokens.
    pair_tokens = [len(lines[2 * k][0]) + len(lines[2 * k + 1][0]) for k in range(5)]  # EOS in
    limit = sorted(pair_tokens)[2] - 2  # the two shortest pairs fit, three do not
    code, out, err = _prepare(
        [
            *base,
            "--source",
            "jsonl",
            "--path",
            str(tmp_path / "p.jsonl"),
            "--out",
            str(tmp_path / "cut"),
            "--truncate",
            str(limit),
        ],
        capsys,
    )
    assert code == 0, err
    assert f"truncate {limit}: 3 pairs left out" in out
    kept = _documents(tmp_path / "cut")
    fits = [k for k in range(5) if pair_tokens[k] <= limit + 1]
    assert len(fits) == 2 and len(kept) == 4
    for j, k in enumerate(fits):  # whole pairs, in order, unchanged
        for side in range(2):
            assert np.array_equal(kept[2 * j + side][0], lines[2 * k + side][0])


@pytest.mark.parametrize(
    "record, problem",
    [
        (
            {
                "prompt": [{"role": "user", "content": "Hi"}],
                "chosen": [],
                "rejected": [{"role": "assistant", "content": "Yo"}],
            },
            "the chosen side is empty",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "Hi"}],
                "chosen": [{"role": "assistant", "content": "Hello"}],
                "rejected": [{"role": "assistant", "content": "  "}],
            },
            "the rejected side's answer is empty",
        ),
        (  # whole conversations that differ before their last answer
            {
                "chosen": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "A"},
                ],
                "rejected": [
                    {"role": "user", "content": "Bye"},
                    {"role": "assistant", "content": "B"},
                ],
            },
            "both sides must answer the same prompt",
        ),
        (
            {
                "prompt": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "A"},
                ],
                "chosen": [{"role": "assistant", "content": "B"}],
                "rejected": [{"role": "assistant", "content": "C"}],
            },
            "the prompt ends with an assistant turn",
        ),
        ({"prompt": "Hi", "chosen": "A", "rejected": "B"}, "'chosen' is text"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no 'chosen' list of messages"),
    ],
)
def test_bad_pairs_are_refused_by_file_and_line(tokenizer_dir, capsys, tmp_path, record, problem):
    good = preference_pairs(2)
    _write(tmp_path / "bad.jsonl", [good[0], good[1], record])
    code, _, err = _prepare(
        [
            "--source",
            "jsonl",
            "--format",
            "preference",
            "--tokenizer",
            str(tokenizer_dir),
            "--path",
            str(tmp_path / "bad.jsonl"),
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 2
    assert "bad.jsonl:3: " in err and problem in err, err


def test_chat_turns_is_refused_with_preference(capsys):
    with pytest.raises(SystemExit):
        prepare(
            [
                "--source",
                "jsonl",
                "--path",
                "x",
                "--out",
                "y",
                "--format",
                "preference",
                "--chat-turns",
                "last",
            ]
        )
    assert "--format preference renders each side's one answer" in capsys.readouterr().err


def test_training_packs_holds_out_and_leaves_out_pairs_whole(tokenizer_dir, capsys, tmp_path):
    _write(tmp_path / "p.jsonl", preference_pairs(16))
    argv = ["--source", "jsonl", "--format", "preference", "--tokenizer", str(tokenizer_dir)]
    code, _, err = _prepare(
        [*argv, "--path", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out")], capsys
    )
    assert code == 0, err
    corpus = PreparedCorpus.open(str(tmp_path / "out"))
    docs = _documents(tmp_path / "out")
    pair_tokens = [len(docs[2 * k][0]) + len(docs[2 * k + 1][0]) for k in range(16)]
    seq_len = sorted(pair_tokens)[-2]  # the longest pair does not fit: left out whole
    sides = {}
    for evaluation in (False, True):
        data = PackedConversations(corpus, seq_len, 0, True, holdout=0.3, evaluation=evaluation)
        seen = []
        for i in range(len(data)):
            sample = data[i]
            first = int(data.first[i])
            count = int(data.first[i + 1]) - first
            assert count % 2 == 0  # whole pairs: chosen at 2j, rejected at 2j + 1
            for k in range(count):
                tokens = sample.input_ids[sample.document_ids == k]
                original = int(np.searchsorted(_starts(corpus), data.starts[first + k]))
                seen.append(original)
                assert np.array_equal(tokens.numpy(), docs[original][0][: len(tokens)])
        assert all(seen[j] % 2 == 0 and seen[j + 1] == seen[j] + 1 for j in range(0, len(seen), 2))
        sides[evaluation] = {d // 2 for d in seen}
    longest = int(np.argmax(pair_tokens))
    assert sides[False].isdisjoint(sides[True])
    assert sides[False] | sides[True] == set(range(16)) - {longest}
    assert sides[True]  # 0.3 of 16 pairs: some are held out


def _starts(corpus: PreparedCorpus) -> np.ndarray:
    ends = corpus.document_ends()
    return np.concatenate([[0], ends[:-1]])
