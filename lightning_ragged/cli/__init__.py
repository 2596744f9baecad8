"""Command-line tools: ``python -m lightning_ragged.plan`` and ``python -m lightning_ragged.consolidate``."""
