"""mtkit: a readable, fast machine-translation toolkit (Transformer NMT from tokenizer to sacreBLEU)."""

__version__ = "0.1.0"
