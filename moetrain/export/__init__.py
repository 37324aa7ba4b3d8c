"""`python -m moetrain.export`: a training checkpoint as a Hugging Face directory.

- `cli`: the command line;
- `merged`: merged weights, streamed a group of parameters at a time;
- `adapters`: a LoRA checkpoint's adapters alone, in the format peft loads.
"""
