"""DeepSeek-V3 (and Moonlight): MLA, group-limited sigmoid routing with a correction bias, shared
experts, dense first layers, MTP. `args`, `model`, `hf`, `spec` (the `ModelSpec`).

Nothing is imported here: the config reads `args` without torch (moetrain/models/__init__.py).
"""
