"""What `train.objective=dpo` adds to a step, by where its reference log-probabilities come
from (`dpo.reference`; `moetrain/loop/preference.py`). A pair's two sides are two documents
of one packed sample, so the step's tokens are SFT's; the reference is what is added:

- base (LoRA's frozen base, the model with its adapters off): one more forward of the
  rank's micro-batches per step, without gradient, before the step's first forward: a
  forward's FLOPs (a third of the training count: 2 of 6 per parameter, 2 of 6 per
  attention score), its EP all-to-all pair and one more all-gather per micro-batch of the
  FSDP units resharded after a forward (those kept gathered, the root and every unit
  under fsdp_gather=step, serve it and the step's forwards: `layout_cost._comm`).
  Nothing of it is saved for a backward: its transients (a block's, the
  logits) come and go before the policy's forward, which holds the same and its saved
  activations, so they do not raise the peak. What it leaves is each micro-batch's
  per-document log-probability sums, [B, S rounded up to even] float64, held from the
  step's start until that micro-batch's loss: the step's micro-batches' at most, at the
  forwards' peak.
- copy (a second, frozen copy of the initial model, full fine-tuning's): the same forward
  and sums, the copy's own gathers, and its parameters, sharded as the model's, resting
  through the run: no gradients, no optimizer state.
- stored (computed once by a first pass of the initial model over the pairs): no forward per
  step; a one-off pass of one forward over the corpus' tokens before training, and its
  table, two float64 sums a pair (chosen, rejected), on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.objective_checks import dpo_reference

# the reference's log-probability sums of a micro-batch's documents: [B, S rounded up to
# even] float64 (`preference.per_document`)
LOGP_BYTES = 8
# a stored side's log-probability: a float64 sum (`preference.PairStats`)
STORED_SUM_BYTES = 8


@dataclass(frozen=True)
class ReferenceCost:
    """What the reference adds to one rank's step (all zero under `train.objective=sft`)."""

    source: str  # none (sft) | base | copy | stored: `dpo.reference`, auto resolved
    forwards: int  # reference forwards per micro-batch: 1 (base, copy) or 0
    resting: list[int]  # per rank, bytes held through the run: the copy, the stored table
    held: int  # bytes held through the forwards: the micro-batches' log-probabilities
    first_pass_tokens: int = 0  # stored: the tokens its one-off pass runs over
    pairs: int = 0  # stored: the pairs its table holds


def reference_source(cfg) -> str:
    """`dpo.reference` as the run resolves it (`dpo_reference`); none for SFT."""
    return dpo_reference(cfg) if cfg.train.objective == "dpo" else "none"


def reference_cost(cfg, dims, state, grad_accum: int) -> ReferenceCost:
    """The reference's cost on one layout: `state` (footprint.ShardedState) is the rank's,
    `grad_accum` its micro-batches per step."""
    source = reference_source(cfg)
    world = dims.world_size
    if source == "none":
        return ReferenceCost(source, 0, [0] * world, 0)
    if source == "stored":
        tokens, pairs = _corpus_size(cfg.data.path)
        return ReferenceCost(source, 0, [pairs * 2 * STORED_SUM_BYTES] * world, 0, tokens, pairs)
    columns = cfg.data.seq_len // dims.cp
    columns += columns % 2  # a document slot per position, pairs of them
    held = grad_accum * cfg.train.micro_batch_size * columns * LOGP_BYTES
    if source == "base":
        return ReferenceCost(source, 1, [0] * world, held)
    # copy (full fine-tuning's: refused under LoRA): the initial model sharded as the policy
    return ReferenceCost(source, 1, list(state.params), held)


def _corpus_size(path: str) -> tuple[int, int]:
    """(tokens, pairs) of a prepared preference corpus, from its manifest."""
    from moetrain.data.prepared import PreparedCorpus

    manifest = PreparedCorpus.open(path).manifest
    return manifest.num_tokens, manifest.num_documents // 2


def reference_report(layout) -> dict | None:
    """The report's "objective" figures of a measured layout (None under SFT)."""
    ref = layout.reference
    if ref is None or ref.source == "none":
        return None
    cfg = layout.cfg
    return {
        "objective": cfg.train.objective,
        "reference": ref.source,
        "reference_forwards_per_micro_batch": ref.forwards,
        "held_bytes": ref.held,
        "resting_bytes": ref.resting,
        "micro_batches": layout.comm["micro_batches"],
        "micro_batch": [cfg.train.micro_batch_size, cfg.data.seq_len // layout.dims.cp],
        **({"first_pass_tokens": ref.first_pass_tokens, "pairs": ref.pairs} if ref.pairs else {}),
    }


def reference_memory_lines(r: dict, unit: float, name: str) -> list[str]:
    """The report's lines on what `dpo.reference` holds (`r`: `reference_report`)."""
    source = r["reference"]
    head = (
        f"(train.objective=dpo, dpo.reference={source}: a pair's two sides are two documents "
        "of one sample, so a step holds SFT's tokens; "
    )
    if source == "stored":
        return [
            head + f"the stored table, {r['pairs']:,} pairs x 2 float64 sums = "
            f"{r['resting_bytes'][0] / unit:.2f} {name} on every rank, is in the peak)"
        ]
    b, s = r["micro_batch"]
    line = (
        head + f"each micro-batch's reference log-probabilities, held from the step's start "
        f"to its loss: {r['micro_batches']} x [{b}, {s + s % 2}] float64 = "
        f"{r['held_bytes'] / unit:.4f} {name} at the forwards' peak; the reference forward saves nothing for backward, its "
        "transients stay under the policy forward's peak"
    )
    if source == "copy":
        line += (
            f"; the copy of the initial model, sharded as the model, rests beside the policy: "
            f"{r['resting_bytes'][0] / unit:.2f} {name} on rank 0, no gradients, no optimizer "
            "state"
        )
    return [line + ")"]


def reference_compute_line(estimate: dict) -> list[str]:
    """The estimate's line on the reference's compute (none under SFT)."""
    source = estimate.get("reference", "none")
    if source == "stored":
        return [
            f"(dpo.reference=stored: no reference forward per step; a one-off first pass, one "
            f"forward over the corpus' {estimate['first_pass_tokens']:,} tokens before "
            f"training: {estimate['first_pass_s']:.1f} s on this layout, not in the step)"
        ]
    if source in ("base", "copy"):
        what = "the frozen base" if source == "base" else "the frozen copy"
        staged = estimate.get("reference_pass_s")
        where = (
            f"; under pipeline stages a forward-only pass before the schedule, {staged:.3f} s "
            "with its fill"
            if staged
            else ""
        )
        return [
            f"(dpo.reference={source}: the step includes one forward of {what} without "
            f"gradient, {estimate['reference_flops_per_rank'] / 1e9:,.1f} GFLOP per rank (a "
            "third of the training count), its EP all-to-all pair a micro-batch, and its FSDP "
            f"all-gathers: in the per-step bytes above{where})"
        ]
    return []
