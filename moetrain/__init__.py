"""moetrain: a PyTorch-native trainer for Mixture-of-Experts language models.

Folders by responsibility, each a layer that imports only the layers listed before it
(`tests/test_import_layers.py` enforces the order):

    models/        plain PyTorch model families on models/common/, and the model contract
    parallelisms/  mesh, FSDP2, EP, the CP ring, pipeline stages, recomputation, compile
    config/        TOML + command line -> a typed, checked JobConfig            (no torch)
    errors.py      the user errors every entry point turns into exit code 2     (no torch)
    fileio.py      atomic writes
    data/          what a run reads: tokenizers, sources, packing, prepared shards, order
    metrics/       the console, metrics.jsonl, TensorBoard, W&B
    hf/            Hugging Face I/O: safetensors in and out, peft's adapter format
    build/         a config -> the built, sharded model (the one place), the optimizer
    checkpoint/    save, verify, restore, resume, continuation, frozen base, adapters to
                   start from, the tokenizer record, the job directory's lock
    loop/          the step loop: Trainer, StepQueue, losses, guard, evaluation, profiling
    train.py       the training command (`torchrun train.py` or `-m moetrain.train`)
    tools, each `python -m moetrain.<tool>`: prepare/ (tokenize a corpus into shards),
                   planner/ (will a launch fit, how fast), evaluate/ (held-out loss of
                   saved weights), generate/ (what a model answers), export/ (a checkpoint
                   as a Hugging Face directory)

`config/`, `errors.py` and what they import never import torch: a refused launch answers at
once.
"""
