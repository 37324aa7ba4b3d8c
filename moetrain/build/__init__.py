"""A config -> the built model: `model` (the meta model, its compute dtype, the plan applied,
this rank's shards), `lora` (adapters on the plan's modules, the frozen base), `optimizer`
(AdamW and the learning-rate schedule; `adamw_bf16` for bf16 moments), `distributed` (the
device and the process group)."""
