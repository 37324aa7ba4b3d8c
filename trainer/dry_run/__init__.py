"""`python -m trainer.dry_run`: will a launch fit? Planned on one CPU process.

- `cli`: the command line, the report and the knob search (`__main__` runs it);
- `layout_cost`: what a layout costs one rank, measured on the meta device over the fake
  process group;
- `footprint`: the measurements (state bytes, the update's temporaries, a storage-lifetime
  trace of one micro-batch);
- `meta_trace`: the instruments (the storage timeline, meta forms of the real kernels).
"""
