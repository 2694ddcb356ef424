"""Multi-LoRA serving: PEFT adapters loaded at runtime and applied per token in one batch.

Torch-free: ``request`` (what a request names), ``config`` (the flags), ``slots`` (which
adapter sits in which device slot) and ``registry`` (names to requests), so the driver can
use them. With torch: ``peft_format`` (reading a PEFT folder), ``layout`` (into the model's
fused, sharded layout), ``ops`` (the batched product), ``layers`` (the wrapped linears) and
``manager`` (a worker's CPU cache and device slots).
"""
