"""`python -m moetrain.prepare` as a fine-tuner uses it around the data: `--show` (what is
trained, decoded), `--truncate` (long conversations kept to their whole turns that fit, not
only left out), a dataset given as one data file, and a summary that reports the sizes read
and written. Each is checked against what transformers, datasets or the file system say."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moetrain.data.conversations import PackedConversations
from moetrain.data.prepared import PreparedCorpus
from moetrain.prepare.chat_messages import Conversation
from moetrain.prepare.chat_turns import Renderer, render_conversation
from moetrain.prepare.cli import main as prepare
from moetrain.prepare.instructions import chat_tokenizer
from moetrain.prepare.show import CLOSE, OPEN
from moetrain.prepare.summary import decimal_size
from tests.chat_model import CHATML, conversations, save_chat_tokenizer
from tests.test_published_templates import (
    CONVS,
    FAMILIES,
    TEMPLATES,
    TOOL_CASES,
    TOOLS,
    _answer_spans,
    _convs,
    _reference,
    _tool_conversation,
)

pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = prepare([*argv, "--workers", "1"]) if "--show" not in argv else prepare(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> tuple[Path, Path, object]:
    """The test conversations (system prompts, one to four answers) as JSON lines, and the
    chat tokenizer's directory and transformers tokenizer."""
    root = tmp_path_factory.mktemp("tools")
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    tok = save_chat_tokenizer(root / "tok", CHATML)
    return path, root / "tok", tok


def _chat_argv(chat, out: Path, *extra: str) -> list[str]:
    path, tok_dir, _ = chat
    source = ["--source", "jsonl", "--format", "chat", "--path", str(path)]
    return [*source, "--tokenizer", str(tok_dir), "--out", str(out), *extra]


def _documents(out: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each prepared document's (ids, mask), its EOS left off."""
    corpus = PreparedCorpus.open(str(out))
    tokens, masks, ends = corpus.tokens()[:], corpus.masks()[:], corpus.document_ends()
    starts = np.concatenate([[0], ends[:-1]])
    return [(tokens[a : b - 1], masks[a : b - 1]) for a, b in zip(starts, ends, strict=True)]


def test_show_prints_documents_decoded_with_the_trained_tokens_marked(chat, capsys, tmp_path):
    _, tok_dir, tok = chat
    out = tmp_path / "prepared"
    assert _run(_chat_argv(chat, out), capsys)[0] == 0
    code, shown, err = _run(["--show", "2", "--out", str(out)], capsys)
    assert code == 0, err
    first = conversations()[0]
    (ids, mask), _ = _documents(out)[:2]
    n, trained = len(ids) + 1, int(mask.sum())  # the EOS is part of the document
    assert f"--- document 0: {n:,} tokens, {trained:,} trained ({trained / n:.1%}) ---" in shown
    assert "--- document 1:" in shown and "--- document 2:" not in shown
    # The answer and its end-of-turn token marked; the system prompt and question not.
    assert f"{OPEN}{first[2]['content']}<|im_end|>{CLOSE}" in shown
    rendered = tok.apply_chat_template(first[:2], tokenize=False, add_generation_prompt=True)
    assert rendered + OPEN in shown
    # A tokenizer that is gone, or another one: refused with the fix, nothing printed.
    code, shown, err = _run(
        ["--show", "1", "--out", str(out), "--tokenizer", str(tmp_path)], capsys
    )
    assert code == 2 and not shown and "pass --tokenizer with that tokenizer.json" in err
    other = tmp_path / "other"
    save_chat_tokenizer(other, CHATML, texts=["a different vocabulary"])
    code, _, err = _run(["--show", "1", "--out", str(out), "--tokenizer", str(other)], capsys)
    assert code == 2 and "is not the tokenizer" in err and str(tok_dir) in err


def _expected_truncation(tok, conv: list[dict], limit: int) -> list[int] | None:
    """transformers' tokens of the conversation cut after its last answer whose rendering fits
    in `limit` tokens (the whole conversation when it fits), None when no answer does."""
    whole = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
    if len(whole) <= limit:
        return list(whole)
    for i in reversed([i for i, m in enumerate(conv) if m["role"] == "assistant"]):
        text = tok.apply_chat_template(conv[: i + 1], tokenize=False).rstrip()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return ids
    return None


def test_truncate_keeps_the_whole_turns_that_fit_and_counts_the_rest(chat, capsys, tmp_path):
    _, _, tok = chat
    limit = 100  # of the 48 conversations: 24 fit, 8 keep their first turns, 16 cannot
    code, out, err = _run(_chat_argv(chat, tmp_path / "cut", "--truncate", str(limit)), capsys)
    assert code == 0, err
    expected = [_expected_truncation(tok, c, limit) for c in conversations()]
    kept = [e for e in expected if e is not None]
    cut = sum(
        e is not None and len(e) < len(tok.apply_chat_template(c, return_dict=False))
        for e, c in zip(expected, conversations(), strict=True)
    )
    dropped = len(expected) - len(kept)
    assert cut and dropped and len(kept) > cut  # the three cases all happen
    assert (
        f"truncate {limit}: {cut} documents longer than {limit} tokens (and EOS) cut after their "
        f"last whole answer that fits, {dropped} left out" in out
    )
    docs = _documents(tmp_path / "cut")
    assert [ids.tolist() for ids, _ in docs] == kept
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for (ids, mask), want in zip(docs, kept, strict=True):
        answers = tok.decode(want).count("<|im_start|>assistant")
        last = int(np.flatnonzero(mask)[-1])  # ends with a whole answer, its stop trained:
        assert ids[last] == im_end and not tok.decode(ids[last + 1 :]).strip()
        assert int(((ids == im_end) & (mask == 1)).sum()) == answers  # each answer trained
    # Training at that length leaves nothing out, and without --truncate it would.
    corpus = PreparedCorpus.open(str(tmp_path / "cut"))
    assert PackedConversations(corpus, limit, 0, True).left_out == 0
    assert _run(_chat_argv(chat, tmp_path / "whole"), capsys)[0] == 0
    whole = PackedConversations(PreparedCorpus.open(str(tmp_path / "whole")), limit, 0, True)
    assert whole.left_out == cut + dropped
    assert f"or prepare the corpus again with --truncate {limit}" in whole.summary.describe(
        limit, len(whole)
    )
    code, _, err = _run(_chat_argv(chat, tmp_path / "none", "--truncate", "20"), capsys)
    assert code == 2 and "--truncate 20 left out every one of the 48 documents" in err


def test_truncate_cuts_text_documents_at_the_limit(chat, capsys, tmp_path):
    texts = ["short", "x" * 40, "é" * 30, "long line " * 120_000]  # the last: streamed
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    source, cut = ["--source", "jsonl", "--path", str(path)], ["--truncate", "16"]
    code, out, err = _run([*source, "--out", str(tmp_path / "o"), *cut], capsys)
    assert code == 0, err
    assert "truncate 16: 3 documents cut at 16 tokens (and EOS)" in out
    corpus = PreparedCorpus.open(str(tmp_path / "o"))
    ends, tokens = corpus.document_ends(), corpus.tokens()[:]
    starts = np.concatenate([[0], ends[:-1]])
    got = [bytes(tokens[a : b - 1].astype(np.uint8)) for a, b in zip(starts, ends, strict=True)]
    assert got == [t.encode()[:16] for t in texts]  # the byte tokenizer: ids are the bytes
    assert "--truncate 16" in corpus.manifest.command and corpus.manifest.source["truncate"] == 16
    # A tokenizer.json: the first 16 ids of each document's whole encoding (the streamed
    # one's included, though it is tokenized in pieces and only until it has them).
    from tokenizers import Tokenizer

    tok_file = chat[1] / "tokenizer.json"  # a byte-level BPE
    argv = [*source, "--tokenizer", str(tok_file), "--out", str(tmp_path / "w"), *cut]
    assert _run(argv, capsys)[0] == 0
    corpus = PreparedCorpus.open(str(tmp_path / "w"))
    ends, tokens = corpus.document_ends(), corpus.tokens()[:]
    starts = np.concatenate([[0], ends[:-1]])
    tok = Tokenizer.from_file(str(tok_file))
    # (Of the long one, a prefix of whole words: byte-level BPE tokenizes each word apart, so
    # its first 16 ids are the whole text's, and encoding 1.2 MB would take seconds.)
    want = [tok.encode(t[:1000], add_special_tokens=False).ids[:16] for t in texts]
    assert [tokens[a : b - 1].tolist() for a, b in zip(starts, ends, strict=True)] == want


def _hf_cache(monkeypatch, tmp_path: Path):
    """datasets, its cache (the tables load_dataset builds) in the test's directory."""
    datasets = pytest.importorskip("datasets", reason="needs the [hf] extra (datasets)")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return datasets


def test_a_dataset_given_as_one_data_file_is_read(capsys, tmp_path, monkeypatch):
    _hf_cache(monkeypatch, tmp_path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + "words " * (i % 7) for i in range(50)]
    pq.write_table(pa.table({"text": texts, "id": list(range(50))}), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("text\n" + "".join(f"{t}\n" for t in texts))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    jsonl = ["--source", "jsonl", "--path", str(tmp_path / "d.jsonl"), "--out"]
    assert _run([*jsonl, str(tmp_path / "from_jsonl")], capsys)[0] == 0
    reference = PreparedCorpus.open(str(tmp_path / "from_jsonl")).tokens()[:]
    for name in ("d.parquet", "d.csv"):
        out = str(tmp_path / f"out_{name}")
        code, _, err = _run(
            ["--source", "hf_datasets", "--path", str(tmp_path / name), "--out", out], capsys
        )
        assert code == 0, err
        tokens = PreparedCorpus.open(out).tokens()[:]
        assert np.array_equal(tokens, reference)  # the same documents as the JSON lines
    parquet = ["--source", "hf_datasets", "--path", str(tmp_path / "d.parquet")]
    code, _, err = _run([*parquet, "--split", "test", "--out", str(tmp_path / "split")], capsys)
    assert code == 2 and "one data file, which datasets reads as the split 'train'" in err


def test_the_summary_reports_the_bytes_read_and_written(capsys, tmp_path, monkeypatch):
    datasets = _hf_cache(monkeypatch, tmp_path)
    import pyarrow as pa

    texts = [f"document {i} " + "text " * (i % 50) for i in range(200)]  # about 30 kB
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    column_bytes = pa.array(texts).nbytes  # the text column as Arrow holds it
    out = tmp_path / "o"
    code, line, err = _run(
        ["--source", "hf_datasets", "--path", str(tmp_path / "saved"), "--out", str(out)], capsys
    )
    assert code == 0, err
    written = sum(os.path.getsize(out / f) for f in os.listdir(out) if f.startswith("shard-"))
    assert f"read {decimal_size(column_bytes)} of Arrow columns in " in line, line
    assert f"wrote {decimal_size(written)} of shards" in line, line
    assert 20_000 < column_bytes < 40_000  # a 28 kB column (was reported as 268.4 MB)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    code, line, _ = _run(
        ["--source", "jsonl", "--path", str(jsonl), "--out", str(tmp_path / "j")], capsys
    )
    assert code == 0 and f"read {decimal_size(jsonl.stat().st_size)} of JSON lines in " in line


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict:
    """Each published template with a small tokenizer of its special tokens."""
    texts = [m["content"] for conv in CONVS for m in conv] + ["What are 2+2 and 3+3? result"]
    toks = {}
    for name, fam in FAMILIES.items():
        template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        directory = tmp_path_factory.mktemp(name)
        save_chat_tokenizer(directory, template, fam.specials, texts, bos=fam.bos, eos=fam.eos)
        toks[name] = chat_tokenizer(str(directory))
    return toks


def test_truncation_points_are_the_ends_of_whole_answers_in_published_templates(published):
    """Where --truncate may end a document: after each trained answer's end-of-turn text
    (for GLM-4.5, which writes none, after its stop target, the next turn's first token),
    found by hand in apply_chat_template's text (tests/test_published_templates.py's
    search), in every rendering mode, tool calls included."""
    checked = 0
    for name, tok in published.items():
        fam = FAMILIES[name]
        cases = [(c, None) for c in _convs(name)]
        if name in TOOL_CASES:  # the templates that take tool calls
            cases.append((_tool_conversation(name == "deepseek_v3_1"), TOOLS))
        for conv, tools in cases:
            for turns in ("auto", "per_turn"):
                docs, mode = render_conversation(
                    Renderer(tok), Conversation(conv, tools), turns, "x:1"
                )
                for doc in [d for d in docs if not d.spliced]:
                    _, text = _reference(tok, name, conv[: doc.rendered], tools)
                    spans = _answer_spans(fam, text)
                    spans = spans if mode == "full" else spans[-1:]
                    ends = [
                        b if fam.end else (stop[1] if stop else len(text)) for (_, b), stop in spans
                    ]
                    starts = [
                        a
                        for a, _ in tok(
                            text, return_offsets_mapping=True, add_special_tokens=False
                        )["offset_mapping"]
                    ]
                    want = tuple(sum(s < end for s in starts) for end in ends)
                    assert doc.answer_ends == want, (name, mode, doc.rendered)
                    checked += len(want)
    assert checked > 100
