"""Workflows: the chains of stages that `mtkit run` carries out (prepare, train, average, translate, score, and the
back-translation and distillation chains before training), the record that tells which stages are up to date,
and the report.

Imports: the leaves, mtkit.data, mtkit.model, mtkit.scoring, mtkit.decoding, mtkit.translation and
mtkit.training; nothing above it (serving, the commands, the API).
"""
