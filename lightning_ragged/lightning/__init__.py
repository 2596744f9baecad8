"""Lightning glue: the strategy, precision plugins, knobs, preemption, elastic restarts and registration.

Kept import-free: ``import lightning_ragged`` must not import Lightning (seconds per process).
"""
