"""Serving: the async engine, the gRPC engine server and the OpenAI-compatible HTTP gateway."""
