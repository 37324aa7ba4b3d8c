"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): `args` (hyper-parameters), `model`, `hf`
(checkpoint mapping), `spec` (the `ModelSpec` the trainer reads).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
