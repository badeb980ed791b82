"""transformers interop: the config and modeling files an export folder carries (they import nothing from
nanochat), and convert.py, which moves checkpoints and the tokenizer between the two formats."""
