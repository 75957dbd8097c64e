"""Serving: ``mtkit serve``'s HTTP API (its requests, routes, gate, metrics, connections and app) and the batcher
that gathers concurrent requests into searches.

Imports: the leaves, mtkit.data (a model's language directions and tokenizers), mtkit.model (LoRA adapters over
the served model), mtkit.decoding (the translator interface and its searches) and mtkit.translation (loading a
model of any engine).
"""
