"""Constrained decoding: grammars compiled from a request's structured outputs, one matcher per sequence."""
