"""Driver-side scheduling state: requests, blocks, the scheduler. Imports no torch."""
