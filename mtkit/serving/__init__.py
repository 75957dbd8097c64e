"""Serving: ``mtkit serve``'s HTTP API and the batcher that gathers concurrent requests into searches.

Imports: the leaves, mtkit.decoding and mtkit.translation.
"""
