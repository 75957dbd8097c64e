"""Model: the encoder-decoder Transformer, its attention and positions, its loss, its file format, and
finding and loading a model on disk.

Imports: the leaves and mtkit.data (the tokenizer a checkpoint carries).
"""
