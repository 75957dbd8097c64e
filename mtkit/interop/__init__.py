"""Interop: other engines and formats. Export to CTranslate2 and translation with it; export to a
transformers ``MarianMTModel`` folder, and import from one (OPUS-MT); what every export folder holds.

Imports: the leaves, mtkit.data, mtkit.model and mtkit.decoding (the translator interface and the
source front end every engine shares, the search's length rules, a shortlist as CTranslate2's
vocabulary map).
"""
