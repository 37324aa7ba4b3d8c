"""The trainer, one room per job; each command is `python -m trainer.<room>[.<tool>]`.

    config/      the job configuration: TOML + command line -> typed, checked JobConfig
    loop/        the training run (`train.py`): set-up, the step, losses, optimizer,
                 bad-step guard, evaluation, profiling
    data/        what a run reads: tokenizers, sources, packing, prepared shards, sample order
    prepare/     `python -m trainer.prepare`: tokenize a corpus once into shards
    checkpoint/  save, verify and resume the whole training state
    hf/          Hugging Face weights in (`model.init_from_hf`) and out
                 (`python -m trainer.hf.export`)
    metrics/     the console, metrics.jsonl, TensorBoard/W&B (`python -m trainer.metrics.plot`)
    dry_run/     `python -m trainer.dry_run`: will a launch fit, planned on one CPU process
    evaluate/    `python -m trainer.evaluate`: the held-out loss of saved weights
    errors.py    the user errors every entry point turns into exit code 2

`config/`, `errors.py` and what they import never import torch: a refused launch answers at
once.
"""
