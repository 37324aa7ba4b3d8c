"""`python -m moetrain.generate`: what a trained model says, from a checkpoint or an export,
on one process (cli.py: the command; inputs.py: the prompts, read and checked; load.py: the
model and tokenizer; batched.py: decoding batches of prompts with kv_cache.py's KV cache,
applied from outside the model; decode.py: picking tokens, and the full-forward decoder
the cached one is held to)."""
