"""The commands of ``mtkit``, one module per job; ``mtkit.cli`` gathers them into one application."""
