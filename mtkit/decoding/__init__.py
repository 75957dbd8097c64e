"""Decoding: mtkit's own engine, a model's searches from source lines to translations.

Greedy, beam and sampled search; the continuous beam search the server steps; ensembles; vocabulary
shortlists; word alignments; ``Translator``, which batches lines by length and keeps their order.

Imports: the leaves, mtkit.data and mtkit.model.
"""
