"""Distributed checkpoints: the whole training state, atomic, verified, reshardable.

- `checkpointer`: `Checkpointer` saves (DCP, optionally async), commits, verifies and loads.
"""
