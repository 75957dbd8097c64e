"""Scoring: BLEU, chrF and TER through sacreBLEU with their signatures, and ``mtkit eval``'s rendering.

Imports: the leaves and mtkit.data (reading text).
"""
