"""User-facing entry points: the Python API and the command line."""
