"""The commands of ``mtkit``, one module per job; ``mtkit.cli`` gathers them into one application. Each is a thin
layer over the library: options parsed, errors turned into one line, the work done by the layers below.

Imports: the leaves, mtkit.data, mtkit.model, mtkit.scoring, mtkit.decoding, mtkit.interop, mtkit.translation,
mtkit.training, mtkit.serving and mtkit.workflows.
"""
