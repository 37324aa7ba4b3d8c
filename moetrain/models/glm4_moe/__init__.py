"""GLM-4.5 MoE (GLM-4.5, GLM-4.5-Air): GQA attention with partial rotary and optional q/k
norms, group-limited sigmoid routing with a correction bias, shared experts, dense first
layers. `args` (hyper-parameters), `model`, `hf` (checkpoint mapping), `spec` (the
`ModelSpec` the trainer reads).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
