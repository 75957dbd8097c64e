"""Translation: one interface over every engine, mtkit's own (mtkit.decoding) or CTranslate2's
(mtkit.interop), and translating files and pipes line by line with it.

Imports: the leaves, mtkit.data, mtkit.model, mtkit.decoding and mtkit.interop.
"""
