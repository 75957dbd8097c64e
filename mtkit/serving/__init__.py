"""Serving: ``mtkit serve``'s HTTP API (its requests, routes, gate, metrics, connections and app), the pool of models
it serves, and the batcher that gathers concurrent requests into searches.

Imports: the leaves, mtkit.data (a model's language directions and tokenizers), mtkit.model (LoRA adapters over
the served model, a checkpoint's header read without its weights), mtkit.decoding (the translator interface and its
searches), mtkit.interop (a CTranslate2 export's manifest) and mtkit.translation (loading a model of any engine).
"""
