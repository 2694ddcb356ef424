"""Stubs generated from protos/raypaged/v1/*.proto by ``make protos``; do not edit."""
