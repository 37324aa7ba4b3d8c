"""OLMoE: q/k norms over all heads, `clip_qkv`. `args`, `model`, `hf`, `spec` (the `ModelSpec`).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
