"""What `python -m moetrain.prepare` prints when it is done (`Summary`): what it prepared,
what it read and wrote, and what it changed on the way in (invalid UTF-8, --truncate)."""

from __future__ import annotations

from dataclasses import dataclass

# What a source's input bytes are, for the summary line: the files' bytes; a dataset's rows
# have none, and count as the Arrow columns read (the data itself, not its compressed file).
INPUT_KINDS = {"jsonl": "JSON lines", "text": "text files", "hf_datasets": "Arrow columns"}


def decimal_size(nbytes: float) -> str:
    """Bytes as a reader wants them: 812 B, 30.7 kB, 268.4 MB, 1.2 GB (powers of 1000)."""
    units, power = ("B", "kB", "MB", "GB"), 0
    while nbytes >= 1000 and power < len(units) - 1:
        nbytes, power = nbytes / 1000, power + 1
    return f"{nbytes:,.0f} B" if power == 0 else f"{nbytes:,.1f} {units[power]}"


@dataclass(frozen=True)
class Summary:
    documents: int
    tokens: int
    shards: int
    units_reused: int
    bytes_read: int  # input bytes tokenized by this run (reused units not counted)
    seconds: float
    replaced: int = 0  # documents with bytes that are not UTF-8 (replaced by U+FFFD)
    replaced_first: str | None = None  # the first of them, in corpus order: file[:line]
    chat_turns: dict | None = None  # --format chat: conversations per mode, and their cost
    format: str = "text"  # --format
    input_kind: str = "input"  # what bytes_read counts (INPUT_KINDS)
    bytes_written: int = 0  # the shards' files in --out (reused ones included)
    truncate: int | None = None  # --truncate SEQ_LEN
    truncated: int = 0  # documents it cut to fit
    dropped: int = 0  # documents it left out (not one whole answer fits)

    def line(self) -> str:
        rate = self.bytes_read / self.seconds if self.seconds > 0 else 0.0
        reused = f", {self.units_reused} shards reused" if self.units_reused else ""
        pairs = f" ({self.documents // 2:,} pairs)" if self.format == "preference" else ""
        return (
            f"prepared {self.documents:,} documents{pairs}, {self.tokens:,} tokens, {self.shards} "
            f"shards: read {decimal_size(self.bytes_read)} of {self.input_kind} in "
            f"{self.seconds:.1f} s ({decimal_size(rate)}/s), wrote "
            f"{decimal_size(self.bytes_written)} of shards{reused}"
        )

    def truncate_line(self) -> str | None:
        """--truncate: how many documents were cut to fit, and how many left out."""
        n = self.truncate
        if n is None:
            return None
        if self.format == "text":
            return f"truncate {n}: {self.truncated:,} documents cut at {n} tokens (and EOS)"
        if self.format == "preference":
            return (
                f"truncate {n}: {self.dropped:,} pairs left out (their two sides, each with "
                f"its EOS, do not fit one sample of {n} tokens; a side's answer is never cut)"
            )
        return (
            f"truncate {n}: {self.truncated:,} documents longer than {n} tokens (and EOS) cut "
            f"after their last whole answer that fits, {self.dropped:,} left out (no answer "
            "they train fits whole)"
        )

    def chat_line(self) -> str | None:
        """--format chat: which rendering trained the conversations, and what it cost."""
        c = self.chat_turns
        if not c or not c["conversations"]:
            return None
        modes = ", ".join(f"{n:,} {mode}" for mode, n in sorted(c["conversations"].items()))
        total = sum(c["conversations"].values())
        return (
            f"chat turns: {total:,} conversations ({modes}) in {c['documents']:,} documents, "
            f"{c['tokens']:,} tokens: {c['tokens'] / max(c['one_rendering'], 1):.2f}x the tokens "
            "of one rendering per conversation"
        )

    def note(self) -> str | None:
        """The line that says text was changed on the way in (None: it was not)."""
        if not self.replaced:
            return None
        documents = f"{self.replaced:,} document{'s' if self.replaced > 1 else ''}"
        return (
            f"note: {documents} held bytes that are not valid UTF-8, prepared with U+FFFD in "
            f"their place (the first: {self.replaced_first}); re-encode the source as UTF-8 "
            "and prepare again to keep the original characters"
        )


def chat_turns_total(results: list[dict]) -> dict:
    """The units' `chat_turns` counts added up (instruction_unit.py)."""
    total: dict = {"conversations": {}, "documents": 0, "tokens": 0, "one_rendering": 0}
    for r in results:
        c = r.get("chat_turns") or {}
        for mode, n in c.get("conversations", {}).items():
            total["conversations"][mode] = total["conversations"].get(mode, 0) + n
        for key in ("documents", "tokens", "one_rendering"):
            total[key] += c.get(key, 0)
    return total
