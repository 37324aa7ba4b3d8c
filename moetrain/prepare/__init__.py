"""`python -m moetrain.prepare`: tokenize a corpus once into prepared token shards.

- `cli`: the command line (`__main__` runs it);
- `plan`: the tokenizer's identity, the files and the deterministic work units;
- `run`: claim the output directory, run the units on worker processes, write the manifest;
- `worker`: one unit in a worker process: read, tokenize, write one shard (no torch);
- `instructions`: `--format chat|prompt_completion`: tokens and the loss mask
  (`instruction_unit`: one such unit);
- `unit_files`: what both kinds of unit write and share (the shard writer, marker names);
- `truncate`: `--truncate SEQ_LEN`, documents cut to whole turns that fit a sample;
- `summary`: the lines printed when done;
- `show`: `--show N`, a prepared directory's documents decoded, trained tokens marked.

The format written is `moetrain.data.shards`'; training reads it with `data.source=tokens`.
"""
