"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): `args` (hyper-parameters), `model`, `hf`
(checkpoint mapping), `spec` (the `ModelSpec` the trainer reads).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
