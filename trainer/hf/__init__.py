"""Hugging Face checkpoint directories (config.json + safetensors), in and out.

- `weights`: read a directory into a sharded model (`model.init_from_hf`), each rank only its
  part; write one from a model (`save_hf_checkpoint`);
- `export`: `python -m trainer.hf.export`: a training checkpoint -> a Hugging Face directory
  (`peft_export`: its adapters alone, with `--adapters`; both read the checkpoint through
  `checkpoint_source`).
"""
