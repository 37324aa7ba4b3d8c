"""`dpo.reference=stored`: full fine-tuning's DPO reference, the initial model's log-probability
sum of each side, computed once by a forward-only pass before step 1 and looked up at each
step by the side's content.

Why by content: a side's reference depends on its own tokens alone (DPO runs with
data.document_mask and data.reset_positions, so what is packed beside it changes nothing),
so the data path stays as it is. A document's key is a 64-bit fingerprint of its tokens,
computed on the device: each position's (input id, label, position in its document) mixed
into 64 pseudo-random bits (the splitmix64 finalizer, a bijection, applied after each
field), summed over the document's positions modulo 2^64 (`per_document`'s scatter_add).
Two different documents differ in some position's triple, so their keys differ by a sum of
pseudo-random words: they collide with probability about 2^-64 per pair, and a corpus of N
documents holds a colliding pair with probability about N^2 / 2^65 (1e-6 at 6 million
documents). The first pass sees every document and refuses a key held by two documents
with different sums, so a collision cannot pass unnoticed into training.

The table (sorted keys, their sums: 16 bytes a document) lives on the training device; a
step looks its documents up with `searchsorted`, without reading anything to the host. A
document that is not there gets NaN: the step's record counts those sides
(`reference_missing`) and the trainer refuses the run when it reads the record (the NaN
loss also makes the guard skip that update). The file and its record in the checkpoints:
moetrain/checkpoint/reference_file.py. `reference_for` says which reference a DPO run uses
(this one, `reference_copy.ReferenceCopy`, or `preference.Reference`: LoRA's base).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from moetrain.build.distributed import Place
from moetrain.checkpoint.reference_file import REFERENCE_FILE, read_reference, write_reference
from moetrain.checkpoint.resume import data_identity
from moetrain.checkpoint.run_state import RunState
from moetrain.config import JobConfig
from moetrain.config.objective_checks import dpo_reference
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.errors import CheckpointError, DataError
from moetrain.loop.batches import Batches
from moetrain.loop.preference import Logps, ModelLogps, Reference, per_document
from moetrain.loop.reference_copy import ReferenceCopy
from moetrain.models.spec import LossTerms, ModelSpec
from moetrain.parallelisms.fsdp import reshard_all

# splitmix64's increment and multipliers, as int64 (torch has no uint64 arithmetic; the
# products wrap modulo 2^64 as unsigned ones would).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MULTIPLIERS = (0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))
# Two first-pass sums of one document (packed elsewhere, so computed apart) agree to
# rounding; a key whose sums differ by more is two documents.
_SAME_SUM = 1e-2


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits as on unsigned 64-bit words (int64's >> copies the sign bit in)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _MULTIPLIERS[0]
    x = (x ^ _shift_right(x, 27)) * _MULTIPLIERS[1]
    return x ^ _shift_right(x, 31)


def document_keys(batch: Batch) -> torch.Tensor:
    """Each document's content fingerprint, [B, W] int64 (`per_document`'s layout, W the
    sequence's length: whole sequences, as `dpo.reference=stored` runs without CP)."""
    h = _mix(batch.input_ids + _GOLDEN)
    h = _mix(h ^ batch.labels)
    h = _mix(h ^ batch.position_ids)
    return per_document(h, batch.document_ids, batch.labels.shape[1])


def _trained(batch: Batch) -> torch.Tensor:
    """Which documents of `per_document`'s layout have trained tokens, [B, W] bool."""
    trained = (batch.labels != IGNORE_INDEX).long()
    return per_document(trained, batch.document_ids, batch.labels.shape[1]) > 0


class ReferenceTable:
    """The stored sums on the training device; called on a micro-batch, its documents' sums
    [B, W] float64 as `Reference` gives them (0 where a document has no trained token, NaN
    where the table lacks it)."""

    def __init__(self, keys: torch.Tensor, sums: torch.Tensor) -> None:
        self.keys, self.sums = keys, sums  # keys sorted, unique

    def __call__(self, batch: Batch) -> torch.Tensor:
        keys = document_keys(batch)
        at = torch.searchsorted(self.keys, keys).clamp(max=self.keys.numel() - 1)
        found = torch.where(self.keys[at] == keys, self.sums[at], torch.nan)
        return torch.where(_trained(batch), found, 0.0)


@torch.no_grad()
def first_pass(reference: Reference, micro_batches: Iterable[Batch]) -> ReferenceTable:
    """The table of every document with trained tokens in `micro_batches` (this rank's),
    gathered over all ranks: each rank computes its share."""
    keys, sums = [], []
    for mb in micro_batches:
        trained = _trained(mb)
        keys.append(document_keys(mb)[trained])
        sums.append(reference([mb], mb.labels.shape[1])[0][trained])
    return _unique(*(_gathered(torch.cat(t)) for t in (keys, sums)))


def _gathered(local: torch.Tensor) -> torch.Tensor:
    """Every rank's `local` (1-D, its own length), concatenated in rank order."""
    world = dist.get_world_size()
    if world == 1:
        return local
    size = torch.tensor([local.numel()], device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(n) for n in sizes]
    padded = torch.cat([local, local.new_zeros(max(lengths) - local.numel())])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, lengths, strict=True)])


def _unique(keys: torch.Tensor, sums: torch.Tensor) -> ReferenceTable:
    """Sorted by key, each key once (a document seen twice: in two samples, on two ranks);
    a key of two documents (their sums differ) is refused."""
    order = torch.argsort(keys)
    keys, sums = keys[order], sums[order]
    repeated = keys[1:] == keys[:-1]
    apart = (sums[1:] - sums[:-1]).abs() > _SAME_SUM * (1 + sums[:-1].abs())
    if bool((repeated & apart).any()):
        raise DataError(
            "dpo.reference=stored: two different documents of the pairs have the same 64-bit "
            "content fingerprint (a chance of about N^2 / 2^65 for N documents); leave out or "
            "edit one pair of the prepared corpus, or use peft.method=lora (dpo.reference=base)"
        )
    first = torch.cat([torch.ones(1, dtype=torch.bool, device=keys.device), ~repeated])
    return ReferenceTable(keys[first], sums[first])


class StoredReference:
    """The reference a `PreferenceLoss` and the evaluation call: empty until `fill` (the
    model must hold its initial weights, or a resume's, first)."""

    def __init__(self) -> None:
        self.table: ReferenceTable | None = None

    def __call__(self, micro_batches: list[Batch], width: int) -> list[torch.Tensor]:
        assert self.table is not None, "StoredReference.fill runs before step 1"
        assert all(mb.labels.shape[1] == width - width % 2 for mb in micro_batches), "no CP"
        return [self.table(mb) for mb in micro_batches]

    def fill(
        self,
        cfg: JobConfig,
        model: nn.Module,
        terms: LossTerms,
        batches: Batches,
        state: RunState,
        resumed_from: str | None,
    ) -> list[str]:
        """A fresh run's first pass (written to job.output_dir, recorded in `state`), or the
        table a resume's checkpoint records. Returns the line to say on the console."""
        path = os.path.join(cfg.job.output_dir, REFERENCE_FILE)
        data = data_identity(batches.order.dataset)["fingerprint"]
        device = next(model.parameters()).device
        if resumed_from is not None:
            keys, sums = read_reference(resumed_from, state.reference, cfg, data)
            self.table = ReferenceTable(keys.to(device), sums.to(device))
            for mb in batches.pair_batches(train=False):  # [eval] may have changed
                if self.table(mb).isnan().any():
                    raise CheckpointError(
                        f"{path} holds no reference for some held-out pairs: the run started "
                        "with other [eval] keys; resume with those"
                    )
            line = f"dpo.reference=stored: {path} as {resumed_from} records it"
        else:
            start = time.perf_counter()
            reference = Reference(ModelLogps(model, terms, cfg.data.document_mask))
            self.table = first_pass(reference, batches.pair_batches())
            reshard_all(model)  # as before the pass: the sharded parameters
            keys, sums = self.table.keys, self.table.sums
            if state.rank == 0:
                state.reference = write_reference(cfg.job.output_dir, keys, sums, cfg, data)
            seconds = time.perf_counter() - start
            line = (
                f"dpo.reference=stored: the initial model's log-probabilities of "
                f"{keys.numel():,} sides of the pairs ({seconds:.1f} s), kept in {path}"
            )
        batches.use_reference(self)
        return [line]


def reference_for(
    cfg: JobConfig, spec: ModelSpec, place: Place, terms: LossTerms, logps: Logps
) -> Reference | StoredReference | ReferenceCopy:
    """What a DPO run's loss takes its reference from (`dpo.reference`; `logps`: the
    policy's forward, which `base` runs with the adapters off); each is `fill`ed once the
    model holds its weights, before step 1."""
    kind = dpo_reference(cfg) if cfg.train.objective == "dpo" else "base"
    if kind == "stored":
        return StoredReference()
    if kind == "copy":
        return ReferenceCopy(cfg, spec, place, terms)
    return Reference(logps)


def refuse_missing(record: dict, step: int) -> None:
    """Refuse the run when a step's pairs held sides the stored reference lacks (the
    record's `reference_missing`, read with the step's figures; removed from the record)."""
    missing = int(record.pop("reference_missing", 0) or 0)
    if missing:
        raise DataError(
            f"step {step}: {missing} sides of the pairs are not in the stored DPO reference "
            f"({REFERENCE_FILE}: the first pass saw other data); start a new job.output_dir, "
            "whose first pass covers this data"
        )
