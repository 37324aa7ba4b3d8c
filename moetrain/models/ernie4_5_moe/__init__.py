"""ERNIE-4.5 MoE (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): `args` (hyper-parameters), `model`,
`hf` (checkpoint mapping), `spec` (the `ModelSpec` the trainer reads).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
