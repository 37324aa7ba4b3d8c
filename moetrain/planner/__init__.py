"""`python -m moetrain.planner`: will a launch fit? Planned on one CPU process.

In layers, bottom to top; a file imports only its own layer or those below it
(docs/overview.md, "Layers"; `tests/test_import_layers.py` checks it):

- hardware: `hardware` (a GPU's rates, its node's links, measured kernel efficiencies);
- costs: `a2a_cost` (the expert all-to-all), `pipeline_schedule` (torch's orders of
  actions, replayed), `pipeline_cost` (a pipelined step's time), `recompute_cost` (what
  `selective` computes again, from the traces' FLOPs), `step_cost` (a step's time:
  compute, FSDP, HSDP, the ring, the all-to-all, stages);
- measurement: `meta_trace` (the instruments: the storage timeline, meta forms of the real
  kernels), `footprint` (state bytes, the update's temporaries), `activation_trace` (a
  storage-lifetime trace of one micro-batch, its routed rows apart), `model_counts` (the model's FLOPs per token and parameters), `shards`
  (the sharded state and FSDP units of a layout, and the cache a search shares), `traces`
  (a layout's trace and the FLOPs counted in it), `pipeline_stages` (each pp rank's
  stages), `workers` (measurements spread over processes);
- layout: `layout_cost` (what a layout costs one rank: bytes at rest, at peak, per step);
- search: `search` (the candidate layouts, ranked by the step-time model);
- cli: `flags`, `report` (the figures and their printed form), `cli` (the command line;
  `__main__` runs it).
"""
