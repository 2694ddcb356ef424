"""The OpenAI-compatible HTTP gateway: FastAPI in front of one or more gRPC engine servers."""
