"""Observability: engine metrics, collective diagnostics, the health/metrics endpoint and the copy counter."""
