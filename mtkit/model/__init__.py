"""Model: the encoder-decoder Transformer, its attention and positions, its loss, and its file format.

Imports: the leaves and mtkit.data (the tokenizer a checkpoint carries).
"""
