"""Data: corpora to tokens and batches. The standard corpora, their download and ``mtkit prepare``'s cleaning
into line-aligned text; Hugging Face datasets as sentence pairs; SentencePiece tokenizers; parallel text read
and cut into token-budget batches; training pairs encoded once into memory-mapped arrays; the directions a
model translates and the language tags that choose one; batches drawn from several corpora.

Imports: the leaves only.
"""
