"""Training: a run from config to checkpoints, single process or under torchrun; averaging checkpoints.

Imports: the leaves, mtkit.data, mtkit.model, mtkit.scoring and mtkit.decoding (validation BLEU), and
mtkit.interop (train.init_from: importing the model a run starts from).
"""
