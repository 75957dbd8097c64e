"""Model: the encoder-decoder Transformer, its attention and positions, its loss, its file format, a run
directory's layout, and finding and loading a model on disk.

Imports: the leaves and mtkit.data (the tokenizer's special ids, and the tokenizer a checkpoint carries).
"""
