"""GPT-OSS: attention sinks, sliding windows on alternating layers, biases on attention,
router and experts, a clamped SwiGLU. `args`, `model`, `hf`, `spec` (the `ModelSpec`).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
