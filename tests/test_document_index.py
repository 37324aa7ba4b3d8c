"""Documents end where the document index says, never at EOS ids inside them: a text may
hold the EOS token's text (the tokenizer reads it as that id) and a chat template may write
EOS inside a conversation (tests/test_finetune.py). For text packed in memory, prepared
shards across shard borders, and the training and held-out views of `eval.fraction`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrain.config import load_config
from moetrain.data.holdout import held_out
from moetrain.data.packing import FlatDocuments, PackedDataset
from moetrain.data.run_data import build_data
from moetrain.data.tokenizers import build_tokenizer
from moetrain.prepare.cli import main as prepare
from tests.chat_model import save_chat_tokenizer

pytest.importorskip("transformers", reason="needs the [hf] extra (a tokenizer with specials)")


def _starts(dataset: PackedDataset) -> set[int]:
    """Stream positions where the trainer starts a document inside a sample (its
    document_ids change; a sample's first token is a start of its own numbering)."""
    seq = dataset.seq_len
    found = set()
    for i in range(len(dataset)):
        ids = dataset[i].document_ids.tolist()
        found |= {i * seq + p for p in range(1, seq) if ids[p] != ids[p - 1]}
    return found


def _expected(documents: list[list[int]], dataset: PackedDataset) -> set[int]:
    """Where `documents`, laid end to end, start inside the samples of `dataset`."""
    seq = dataset.seq_len
    ends = np.cumsum([len(d) for d in documents])[:-1]
    return {int(e) for e in ends if e < len(dataset) * seq and e % seq}


def test_an_eos_id_inside_an_in_memory_document_does_not_end_it():
    eos = 9
    tokens = np.array([1, eos, 2, eos, 3, 4, eos, 5, eos], dtype=np.int32)  # 2 documents
    stream = FlatDocuments(tokens, np.array([4, 9]))
    sample = PackedDataset(stream, seq_len=8, eos_id=eos, reset_positions=True)[0]
    assert sample.document_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sample.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("fraction", [None, 0.3], ids=["all", "held_out_views"])
def test_prepared_text_documents_holding_the_eos_text_stay_whole(tmp_path, fraction):
    tok = save_chat_tokenizer(tmp_path / "tok")  # EOS: <|im_end|>, one token
    eos = tok.eos_token_id
    texts = [
        f"doc {i} says {'<|im_end|> ' * (i % 3)}and goes on " + "word " * (i % 7) for i in range(40)
    ]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "prepared"
    argv = ["--source", "jsonl", "--path", str(source), "--tokenizer", str(tmp_path / "tok")]
    assert prepare([*argv, "--out", str(out), "--workers", "1", "--shard-mb", "0.001"]) == 0
    cfg = load_config(
        ["--data.source=tokens", f"--data.path={out}", f"--data.tokenizer={tmp_path / 'tok'}",
         "--data.seq_len=32", "--data.reset_positions=true",
         *([f"--eval.fraction={fraction}", "--eval.samples=1"] if fraction else [])]
    )  # fmt: skip
    tokenizer = build_tokenizer(cfg.data)
    data = build_data(cfg.data, cfg.eval, tokenizer)
    encoded = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    assert sum(ids.count(eos) for ids in encoded) > len(texts)  # EOS ids inside documents
    held = held_out(np.arange(len(texts)), fraction) if fraction else np.zeros(len(texts), bool)
    views = [(data.train, ~held)] + [(h.dataset, held) for h in data.held_out]
    for dataset, chosen in views:
        documents = [ids for ids, keep in zip(encoded, chosen, strict=True) if keep]
        assert _starts(dataset) == _expected(documents, dataset)
