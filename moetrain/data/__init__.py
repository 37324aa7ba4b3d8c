"""Training data: tokenizers, document sources, sequence packing and the global sample order.

    source (documents as str) -> tokenizer -> one flat token stream, EOS after each document
    -> PackedDataset (sample i = tokens[i * seq_len : i * seq_len + seq_len + 1], a `Batch`)
    -> GlobalBatchSampler (which samples each rank reads at each step) -> StatefulDataLoader

- `reader` (and `hf_rows` for datasets): the corpus reading rules, shared with `prepare`;
- `tokenizers`, `sources` (documents of the in-memory sources), `packing`, `batch`;
- `shards`: the prepared-token format and its reader (`python -m moetrain.prepare` writes it);
- `corpus`: which token stream a run trains on, checked before any process group;
- `sampler` + `permutation`: the global sample order; `loader`: this rank's loader;
- `mixture`: `[[data.mix]]`, corpora blended by weight; `holdout`: `eval.fraction`'s held-out
  documents; `run_data`: everything a run reads (training and held-out datasets).

The sample order depends only on (seed, num_samples, global_batch_size), never on the number
of data-parallel ranks or the micro-batch size, so a run can resume on another layout at a
step boundary and still see exactly the samples it would have seen.

NOTE: nothing is imported here: `reader` and `shards` are used by `prepare`'s worker
processes, which must not pay for torch.
"""
