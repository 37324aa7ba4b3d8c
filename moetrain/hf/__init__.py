"""Hugging Face I/O as a library (the export tool, `moetrain.export`, is built on it):

- `weights`: read a directory (config.json + safetensors) into a sharded model
  (`model.init_from_hf`), each rank only its part; write one from a model
  (`save_hf_checkpoint`, `SafetensorsWriter`);
- `export_dir`: a directory replaced whole, never mixed with an older one;
- `peft_format`: our LoRA adapters <-> peft's adapter files;
- `stop_tokens`: the tokens a chat template ends an assistant turn with.
"""
