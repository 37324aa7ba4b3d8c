"""The checkpoint lifecycle: the whole training state, atomic, verified, reshardable.

Saving and reading:
- `checkpointer`: `Checkpointer` saves (DCP, optionally async), commits, verifies and loads;
- `writes`: the room a save needs on the disk, and why a write failed (a failed save is
  removed; the older checkpoints stay intact); `checksums`: every rank's, gathered to commit;
- `markers`: which checkpoints on disk are complete, and what is wrong with a damaged one;
- `job_lock`: one live run per job directory (`run.lock`, held by rank 0, released by the
  kernel when the process ends).

How a run starts and what its checkpoints hold:
- `run_checkpoints`: `RunCheckpoints`: init, HF weights, a resume or a continuation, then
  the saves; `run_state`: what `trainer_state.pt` holds besides the weights;
- `resume`: which checkpoint a run may resume from; `continuation`: a new run from another
  run's checkpoint (`checkpoint.init_from`);
- `frozen_base`: where a LoRA run's frozen weights came from; `initial_adapters`: LoRA
  adapters to start from (`peft.init_from`);
- `tokenizer_record`: the tokenizer a checkpoint records; `tokenizer_files`: its files
  written back for an export or generation;
- `whole_model`: a checkpoint's model outside training (its spec, args, state; whole on CPU).
"""
