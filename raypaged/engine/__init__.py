"""The engine: tokenization, the scheduler/executor step loop, detokenization."""
