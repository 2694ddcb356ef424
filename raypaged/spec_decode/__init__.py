"""Speculative decoding: proposers of draft tokens and the verification rule (see ``verify.py``)."""
