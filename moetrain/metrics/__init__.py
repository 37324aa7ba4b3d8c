"""Where a run's numbers go.

- `logger`: the console line with progress bar (rank 0) and `metrics.jsonl`;
- `sinks`: TensorBoard events and W&B, optional;
- `plot`: `python -m moetrain.metrics.plot OUTPUT_DIR`: PNGs from `metrics.jsonl`.
"""
