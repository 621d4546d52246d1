"""Prometheus `/metrics` (docs/specs/metrics.md): vLLM's metric names where vLLM has one, so
that dashboards written for vLLM read this server too; the rest under `omlx_`."""
