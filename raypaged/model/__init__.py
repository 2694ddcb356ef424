"""Decoder-only model code computing over the flattened tokens of a step."""
