"""`torchrun --nproc_per_node=N train.py --config FILE.toml [--section.key=value ...]`: the
training command from a clone; `moetrain.train` holds it (also `torchrun -m moetrain.train`).
Bad configs and layouts are refused before any process group exists (exit 2)."""

from moetrain.train import exit_now, main

if __name__ == "__main__":
    exit_now(main())
