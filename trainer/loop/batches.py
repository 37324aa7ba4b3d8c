"""What a run reads: its data (`trainer.data.run_data`), this rank's micro-batches of each
global batch in the sampler's order, on the training device, and the held-out documents
the evaluation reads (`trainer.loop.evaluation`)."""

from __future__ import annotations

import torch

from models.spec import LossTerms
from trainer.config import JobConfig
from trainer.data.batch import Batch
from trainer.data.loader import build_dataloader
from trainer.data.prepared import Corpora
from trainer.data.run_data import build_data
from trainer.data.tokenizers import build_tokenizer
from trainer.errors import DataError
from trainer.loop.evaluation import Evaluator, batch_preparer


class Batches:
    """This rank's micro-batches; `sampler` holds the order and the position in it."""

    def __init__(
        self,
        cfg: JobConfig,
        dp_rank: int,
        dp_size: int,
        cp: int,
        cp_rank: int,
        grad_accum: int,
        terms: LossTerms,
        device: torch.device,
        corpora: Corpora | None,
    ) -> None:
        """`dp_rank`, `dp_size`: this rank's place among the ranks that split the global
        batch; `cp`, `cp_rank`: the context-parallel degree and this rank's part of each
        sequence; `grad_accum`: micro-batches a step; `terms`: the loss terms (MTP reads
        targets ahead); `corpora`: the prepared directories preflight opened (None: opened
        here)."""
        self.grad_accum = grad_accum
        tokenizer = build_tokenizer(cfg.data)
        # The model's vocabulary bounds every id read (part of the contract, models/spec.py).
        vocab = cfg.model.args.vocab_size
        self.data = build_data(cfg.data, cfg.eval, tokenizer, vocab, corpora)
        self.loader, _ = build_dataloader(
            cfg.data, cfg.train, dp_rank, dp_size, tokenizer, data=self.data
        )
        self.sampler = self.loader.batch_sampler  # the sample order (trainer.data.sampler)
        self._data_iter = None
        self.prepare_batch = batch_preparer(
            device, terms.mtp_depth, cp, cp_rank, cfg.parallel.cp_layout
        )
        self.evaluator = None
        if self.data.held_out:
            self.evaluator = Evaluator(
                self.data.held_out,
                cfg.eval.micro_batch_size,
                dp_rank,
                dp_size,
                self.prepare_batch,
                terms,
                cfg.data.document_mask,
            )

    def next_micro_batches(self) -> list[Batch]:
        """This rank's micro-batches of the next global batch, on the training device."""
        if self._data_iter is None:
            self._data_iter = iter(self.loader)  # one iterator: re-iterating drops prefetch
        batches = []
        for _ in range(self.grad_accum):
            try:
                batch = next(self._data_iter)
            except DataError as err:  # from a loader worker: its traceback is in the message
                raise DataError(str(err).rstrip().rpartition("DataError: ")[2]) from None
            batches.append(self.prepare_batch(batch))
        return batches
