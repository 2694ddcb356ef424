"""Paged attention: metadata built by the model runner and the ops that use it."""
