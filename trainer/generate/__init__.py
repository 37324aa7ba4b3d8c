"""`python -m trainer.generate`: what a trained model says, from a checkpoint or an export,
on one process (cli.py: the command; load.py: model and tokenizer; decode.py: the loop)."""
