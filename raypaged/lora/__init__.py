"""Multi-LoRA serving: PEFT adapters loaded at runtime and applied per token in one batch.

Torch-free: ``request`` (what a request names) and ``config`` (the flags), for the driver.
With torch: ``peft_format`` (reading a PEFT folder), ``layout`` (checking it against the
model and sharding it into the fused linears), ``ops`` (the batched product), ``layers``
(the wrapped linears) and ``manager`` (a worker's CPU cache and device slots). The driver
plans which adapter sits in which slot (``raypaged/core/lora_plan.py``).
"""
