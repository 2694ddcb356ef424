"""Worker side: model weights, KV cache tensors, forward passes, sampling."""
