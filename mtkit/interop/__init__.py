"""Interop: other engines and formats. Export to CTranslate2 and translation with it; export to a
transformers ``MarianMTModel`` folder.

Imports: the leaves, mtkit.data, mtkit.model and mtkit.decoding (the translator interface and the
source front end every engine shares).
"""
