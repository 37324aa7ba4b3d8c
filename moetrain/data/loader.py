"""This rank's resumable loader of micro-batches."""

from __future__ import annotations

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from moetrain.config import DataSection, TrainSection
from moetrain.data.batch import Batch
from moetrain.data.mixture import BlendedOrder
from moetrain.data.run_data import RunData, build_data
from moetrain.data.sampler import GlobalBatchSampler
from moetrain.data.tokenizers import Tokenizer, build_tokenizer
from moetrain.parallelisms.dims import grad_accum_steps


def build_dataloader(
    data_cfg: DataSection,
    train_cfg: TrainSection,
    dp_rank: int = 0,
    dp_size: int = 1,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    data: RunData | None = None,
) -> tuple[StatefulDataLoader, Tokenizer]:
    """This rank's infinite loader of micro-batches (`Batch`, [micro_batch_size, seq_len]
    tensors), and the tokenizer it used. Prepared token ids are checked against
    `vocab_size` (the model's) as they are read.

    Call iter() once and keep the iterator (the stream is infinite): with workers, a new
    iterator drops the micro-batches the old one had prefetched. The position in the
    sample stream lives on `loader.batch_sampler` (a `GlobalBatchSampler`), whose
    `state_at`/`load_state_dict` save and restore it on any layout. `data`: the run's data
    when already built (`moetrain.data.run_data.build_data`: a blend of `[[data.mix]]` is read
    in its blended order); else it is built here from `data_cfg`.
    """
    # Cheap layout arithmetic first, before spending time reading and tokenizing.
    grad_accum_steps(train_cfg.global_batch_size, train_cfg.micro_batch_size, dp_size)
    if tokenizer is None:
        tokenizer = build_tokenizer(data_cfg)
    if data is None:
        data = build_data(data_cfg, None, tokenizer, vocab_size)
    dataset, blend = data.train, None
    if data.sources:
        blend = BlendedOrder(
            [s.name for s in data.sources],
            [len(s.dataset) for s in data.sources],
            [s.weight for s in data.sources],
            train_cfg.global_batch_size,
            train_cfg.seed,
            data_cfg.shuffle,
        )
    sampler = GlobalBatchSampler(
        num_samples=len(dataset),
        global_batch_size=train_cfg.global_batch_size,
        micro_batch_size=train_cfg.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=train_cfg.seed,
        shuffle=data_cfg.shuffle,
        blend=blend,
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API that recent torch deprecated; nothing we can act on.
        warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
        loader = StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=data_cfg.num_workers,
            collate_fn=Batch.stack,
        )
    return loader, tokenizer
