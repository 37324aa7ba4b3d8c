"""Distributed checkpoints: the whole training state, atomic, verified, reshardable.

- `checkpointer`: `Checkpointer` saves (DCP, optionally async), commits, verifies and loads;
- `markers`: which checkpoints on disk are complete, and what is wrong with a damaged one;
- `job_lock`: one live run per job directory (`run.lock`, held by rank 0, released by the
  kernel when the process ends);
- `commit`: what a save needs besides DCP: room on the disk, every rank's checksums, and the
  message when it fails (a failed save is removed; the older checkpoints stay intact).
"""
