"""What a run reads: its data (`moetrain.data.run_data`), this rank's micro-batches of each
global batch in the sampler's order, on the training device, and the held-out documents
the evaluation reads (`moetrain.loop.evaluation`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

from moetrain.build.distributed import Place
from moetrain.config import JobConfig
from moetrain.data.batch import Batch
from moetrain.data.loader import build_dataloader
from moetrain.data.prepared import Corpora
from moetrain.data.run_data import build_data
from moetrain.data.sampler import SampleOrder
from moetrain.data.tokenizers import build_tokenizer
from moetrain.errors import DataError
from moetrain.loop.evaluation import Evaluator, batch_preparer, rank_micro_batches
from moetrain.loop.preference import ReferenceSums
from moetrain.loop.run_report import data_lines, source_tokens
from moetrain.models.spec import LossTerms


class Batches:
    """This rank's micro-batches (`next_micro_batches`), the order they come in (`order`:
    what a checkpoint records), the held-out loss (`evaluate`) and the lines that describe
    the data (`describe`)."""

    def __init__(
        self, cfg: JobConfig, place: Place, terms: LossTerms, corpora: Corpora | None
    ) -> None:
        """`place`: this rank's among the ranks that split the global batch and the parts of
        each sequence; `terms`: the loss terms (MTP reads targets ahead); `corpora`: the
        prepared directories preflight opened (None: opened here)."""
        t, dims, meshes = cfg.train, place.dims, place.meshes
        self.cfg = cfg
        self.grad_accum = dims.grad_accum(t.global_batch_size, t.micro_batch_size)
        dp_rank, dp_size = meshes.dp_rank(), dims.dp_size
        self._dp_rank, self._dp_size = dp_rank, dp_size
        cp_rank = meshes.world.get_local_rank("cp")
        tokenizer = build_tokenizer(cfg.data)
        # The model's vocabulary bounds every id read (the contract: moetrain/models/spec.py).
        vocab = cfg.model.args.vocab_size
        self._data = build_data(cfg.data, cfg.eval, tokenizer, vocab, corpora)
        self._loader, _ = build_dataloader(
            cfg.data, t, dp_rank, dp_size, tokenizer, data=self._data
        )
        self.order = SampleOrder(self._loader.dataset, self._loader.batch_sampler)
        self._data_iter = None
        self.prepare_batch = batch_preparer(
            place.device, terms.mtp_depth, dims.cp, cp_rank, cfg.parallel.cp_layout
        )
        self._evaluator = None
        if self._data.held_out:
            self._evaluator = Evaluator(
                self._data.held_out,
                cfg.eval.micro_batch_size,
                dp_rank,
                dp_size,
                self.prepare_batch,
                terms,
                cfg.data.document_mask,
                cfg.dpo if cfg.train.objective == "dpo" else None,
                meshes.world.get_group("cp"),
            )

    def next_micro_batches(self) -> list[Batch]:
        """This rank's micro-batches of the next global batch, on the training device."""
        if self._data_iter is None:
            self._data_iter = iter(self._loader)  # one iterator: re-iterating drops prefetch
        batches = []
        for _ in range(self.grad_accum):
            try:
                batch = next(self._data_iter)
            except DataError as err:  # from a loader worker: its traceback is in the message
                raise DataError(str(err).rstrip().rpartition("DataError: ")[2]) from None
            batches.append(self.prepare_batch(batch))
        return batches

    def pair_batches(self, train: bool = True) -> Iterator[Batch]:
        """This rank's share of every training sample (`train`) and every held-out one, in
        micro-batches on the training device, each rank as many: what
        `dpo.reference=stored`'s first pass reads (moetrain.loop.stored_reference)."""
        sources = [(self.order.dataset, len(self.order.dataset))] if train else []
        sources += [(h.dataset, h.samples) for h in self._data.held_out]
        size = self.cfg.train.micro_batch_size
        for dataset, samples in sources:
            for mb in rank_micro_batches(dataset, samples, size, self._dp_rank, self._dp_size):
                yield self.prepare_batch(mb)

    def use_reference(self, reference: ReferenceSums) -> None:
        """The held-out pairs' reference from now on (dpo.reference=stored's table, or
        copy's model)."""
        if self._evaluator is not None:
            self._evaluator.reference = reference

    @property
    def has_held_out(self) -> bool:
        return self._evaluator is not None

    def evaluate(self, model: nn.Module, forward_only: Callable | None) -> dict[str, float]:
        """The held-out loss of `model`'s current weights (moetrain.loop.evaluation);
        `forward_only`: under pipeline stages, the stages' forward."""
        return self._evaluator(model, forward_only)

    def describe(self) -> list[str]:
        """The data as the run's start-up lines say it: the corpus, each source of a blend,
        the held-out data."""
        return data_lines(self.cfg, self.order.dataset, self._data)

    def blend_tokens(self, consumed_samples: int) -> dict:
        """Each source's share of the tokens read so far (a blend only; else empty)."""
        blend = self.order.sampler.blend
        return {} if blend is None else source_tokens(blend, consumed_samples, self.cfg)
