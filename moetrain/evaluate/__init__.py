"""`python -m moetrain.evaluate`: the held-out loss of saved weights, on any layout.

- `cli`: the command line (`__main__` runs it): a checkpoint of this trainer or a Hugging
  Face model directory, evaluated on the `[eval]` data of a job config with
  `moetrain.loop.evaluation.Evaluator`, the same code the training loop runs.
"""
