"""gRPC settings both ends of the engine connection share."""

from __future__ import annotations

# Request size is bounded by the gateway's body limit; the gRPC defaults (4 MiB) would refuse smaller ones.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# trailing metadata of an INVALID_ARGUMENT: the request field at fault (the gateway's OpenAI ``param``)
PARAM_METADATA_KEY = "raypaged-param"
# The gateway retries a lost engine within a second instead of backing off for minutes.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
