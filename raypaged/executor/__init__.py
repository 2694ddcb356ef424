"""Executors drive the workers: in-process now, Ray actors for tensor parallelism."""
