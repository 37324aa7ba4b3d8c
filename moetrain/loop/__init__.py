"""The training run that `train.py` starts.

- `setup`: the checks before any process group (`preflight`), the device, the process group;
- `trainer`: `Trainer` builds the model, data, checkpointer and metrics, then `fit()` steps;
- `losses`: `StepLoss`, the loss of one step as shares of the global batch;
- `optim`: AdamW and the learning rate as a function of the step;
- `balance`: the aux-loss-free routing-bias update (an optimizer pre-step hook);
- `resume`: which checkpoint a run may resume from (model, step boundary, data identity);
- `evaluation`: the held-out loss (`[eval]`), the same on every layout;
- `report`: the start-up lines and each step's figures;
- `guard`: skipping steps whose loss or gradient norm is not finite (or spikes);
- `profiling`: `torch.profiler` over chosen steps, and the named ranges it records.
"""
