"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): `args` (hyper-parameters), `model`, `hf`
(checkpoint mapping), `spec` (the `ModelSpec` the trainer reads).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
