"""Translation: one interface over every engine, mtkit's own (mtkit.decoding) or CTranslate2's
(mtkit.interop), translating files and pipes line by line with it, reranking each line's candidates, and filtering
parallel text by what two models make of it.

Imports: the leaves, mtkit.data, mtkit.model, mtkit.scoring, mtkit.decoding and mtkit.interop.
"""
