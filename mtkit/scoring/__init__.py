"""Scoring: BLEU, chrF and TER through sacreBLEU with their signatures, COMET and CometKiwi natively over
transformers' XLM-R encoder, and ``mtkit eval``'s rendering.

Imports: the leaves, mtkit.data (reading text) and mtkit.model (torch files read safely, int8 layers).
"""
