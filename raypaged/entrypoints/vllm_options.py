"""vLLM's ``vllm serve`` options that are no ``EngineConfig`` field or gateway flag of raypaged's own:
each is taken at the values raypaged honours and refused by name at any other (``DEFAULT_ONLY``,
``SERVER_DEFAULT_ONLY``), or taken at any value where it changes nothing here (``ANY_VALUE``,
``SERVER_ANY_VALUE``), each with the reason. ``ENGINE`` options are also ``LLM`` keywords (as vLLM's
``EngineArgs`` are); ``SERVER`` ones exist on the command line only. ``{name}`` in a reason is an option's
spelling: a flag on the command line, a keyword in ``LLM()``. ``list`` options take one or more values."""

from __future__ import annotations

# option (as a keyword), its short flags, type, the values taken (the first is the default), why another is refused
Option = tuple[str, tuple[str, ...], type, tuple[object, ...], str]

_CHUNKED = "long prefills are always chunked within {max_num_batched_tokens}"
_OWN_IMPL = "raypaged runs its own implementation of each supported architecture"
_EXPERTS_TP = (
    "experts are split over the shards by tensor parallelism, or whole and in equal contiguous groups with "
    "{enable_expert_parallel} (no data parallelism, all-to-all, load balancing or placement strategies)"
)
_NO_ROUTED = "the experts' routing stays inside the engine (no routed experts are returned)"
_TORCH_EXPERTS = "the experts run in torch, routed as transformers routes them"
_NO_EXPERT_LORA = "LoRA adapters adapt a mixture-of-experts model's attention, never its experts"
_TEXT_ONLY = (
    "image inputs take no other options here: the model's own image processor reads them (with "
    "--mm-processor-kwargs' pixel bounds for Qwen-VL) and its vision tower encodes them in the step"
)
_NO_DP = (
    "`raypaged serve` runs its data-parallel ranks as engine processes on its own node (--data-parallel-size); "
    "for ranks on other nodes run `raypaged engine` on each and name every one on `raypaged gateway` "
    "(--engine NAME=host:port, once per rank)"
)
_ONE_ENGINE = (
    "this runs one engine; `raypaged serve -dp N` runs N engine processes behind its gateway, and `raypaged "
    "gateway` balances over the engines named with --engine NAME=host:port, once per rank"
)
_NO_MAMBA = "no Mamba (state-space) architecture is supported"
_NO_PLUGINS = "raypaged imports no plugin or user code"
_NO_DCP = "tensor parallelism shards heads, and each shard keeps its heads' whole context (no context parallelism)"
_NO_OFFLOAD = "weights stay on the device"
_LOADER = "tensors are read from memory-mapped safetensors files as each shard places them"
_NO_TRACING = "raypaged exports Prometheus metrics (/metrics) and request log lines, no traces or profiles"
_NO_SLEEP = (
    "{enable_sleep_mode} releases the weights and the KV cache by freeing them, and wake_up reads the weights back "
    "from the checkpoint (no cumem allocator)"
)
_ONE_CHUNKED = "long prompts are not limited apart from the others: each is cut at {long_prefill_token_threshold}"
_KERNELS = "raypaged's kernels are chosen per device"


DEFAULT_ONLY: list[Option] = [
    ("data_parallel_size", ("-dp",), int, (1,), _ONE_ENGINE),
    ("max_long_partial_prefills", (), int, (1,), _ONE_CHUNKED),
    ("long_prefill_token_threshold_adaptive", (), bool, (False,), _ONE_CHUNKED),
    ("cpu_offload_gb", (), float, (0.0,), _NO_OFFLOAD),
    ("distributed_executor_backend", (), str, (None, "ray"), "shards are Ray actors (ray)"),
    (
        "enable_chunked_prefill",
        (),
        bool,
        (None, True),
        "long prefills are always chunked within {max_num_batched_tokens}",
    ),
    (
        "max_num_partial_prefills",
        (),
        int,
        (1,),
        "prompts are chunked within the step's {max_num_batched_tokens} and {long_prefill_token_threshold}, with no "
        "other bound on how many are partly prefilled at once, as vLLM V1's scheduler; only its default 1 is taken",
    ),
    (
        "task",
        (),
        str,
        ("auto", "generate"),
        "{task} is vLLM's older spelling of {runner} and {convert}: embed, classify and score are taken (as {runner} "
        "pooling), generate and auto as they are; no reward or transcription task",
    ),
    (
        "compilation_config",
        ("-O", "-cc"),
        str,
        (None, "0"),
        "the model is not compiled with torch.compile (level 0); CUDA graphs are on unless {enforce_eager}",
    ),
    (
        "optimization_level",
        (),
        int,
        (None, 0),
        "the model is not compiled with torch.compile (level 0); CUDA graphs are on unless {enforce_eager}",
    ),
    ("enable_cumem_allocator", (), bool, (None, False), _NO_SLEEP),
    ("sleep_mode_backend", (), str, ("cumem",), _NO_SLEEP),
    ("sleep_mode_offload_cudagraph", (), bool, (False,), _NO_SLEEP),
    ("sleep_preserve_parameter_names", (), list, (None,), _NO_SLEEP),
    ("enable_nccl_comm_suspend", (), bool, (False,), _NO_SLEEP),
    ("checkpoint_prepare_on_startup", (), bool, (False,), _NO_SLEEP),
    ("skip_tokenizer_init", (), bool, (False,), "the engine tokenizes prompts and detokenizes outputs itself"),
    ("model_impl", (), str, ("auto",), "raypaged runs its own implementation of each supported architecture"),
    (
        "model_class_overrides",
        (),
        str,
        (None,),
        "raypaged runs its own implementation of each supported architecture",
    ),
    (
        "prefix_caching_hash_algo",
        (),
        str,
        ("sha256",),
        "prefix-cache blocks are keyed by sha256 of their parent's key and their token ids",
    ),
    # model
    ("quantization_config", (), str, (None,), "{quantization} and the checkpoint's quantization_config choose it"),
    ("enable_return_routed_experts", (), bool, (None, False), _NO_ROUTED),
    ("return_sampling_mask", (), bool, (None, False), "responses carry tokens and logprobs, no sampling masks"),
    ("use_fp64_gumbel", (), bool, (None, False), "tokens are drawn by inverse CDF from each row's generator"),
    ("enable_trace_replay", (), bool, (None, False), _NO_TRACING),
    ("logits_processors", (), list, (None,), _NO_PLUGINS),
    ("io_processor_plugin", (), str, (None,), _NO_PLUGINS),
    ("renderer_num_workers", (), int, (1,), "prompts are rendered and tokenized by one input processor per model"),
    # load
    (
        "safetensors_load_strategy",
        (),
        str,
        (None, "lazy"),
        f"{_LOADER} (lazy); other checkpoint formats are refused at load",
    ),
    ("safetensors_prefetch_num_threads", (), int, (None, 8), _LOADER),
    ("safetensors_prefetch_block_size", (), str, (None,), _LOADER),
    ("model_loader_extra_config", (), str, (None, "{}"), _LOADER),
    ("use_tqdm_on_load", (), bool, (None, False), "loading draws no progress bar"),
    (
        "ignore_patterns",
        (),
        list,
        (None, ["original/**/*"]),
        "the weights are the *.safetensors files at the top of the model folder (nothing under original/ is read)",
    ),
    ("pt_load_map_location", (), str, (None, "cpu"), "only safetensors checkpoints are read (no .pt files)"),
    ("shuffle_safetensors_files", (), bool, (False,), f"{_LOADER}, in the files' order"),
    # parallel
    ("master_addr", (), str, (None, "127.0.0.1"), "Ray places the shards: join a cluster with {ray_address}"),
    ("master_port", (), int, (None, 29501), "Ray places the shards: join a cluster with {ray_address}"),
    ("nnodes", ("-n",), int, (None, 1), "Ray places the shards: join a cluster with {ray_address}"),
    ("node_rank", ("-r",), int, (None, 0), "Ray places the shards: join a cluster with {ray_address}"),
    ("distributed_timeout_seconds", (), int, (None,), "a shard that stalls is found by the engine's step watchdog"),
    ("cpu_distributed_timeout_seconds", (), int, (None,), "a shard that stalls is found by the step watchdog"),
    ("numa_bind", (), bool, (None, False), "Ray places the shards; their threads are not bound to NUMA nodes"),
    ("numa_bind_nodes", (), list, (None,), "Ray places the shards; their threads are not bound to NUMA nodes"),
    ("numa_bind_cpus", (), list, (None,), "Ray places the shards; their threads are not bound to NUMA nodes"),
    ("device_ids", (), str, (None,), "Ray gives each shard its GPU: choose them with CUDA_VISIBLE_DEVICES"),
    ("decode_context_parallel_size", ("-dcp",), int, (1,), _NO_DCP),
    ("dcp_comm_backend", (), str, (None,), _NO_DCP),
    ("dcp_q_replicate", (), bool, (None,), _NO_DCP),
    ("dcp_kv_cache_interleave_size", (), int, (1,), _NO_DCP),
    ("cp_kv_cache_interleave_size", (), int, (1,), _NO_DCP),
    ("prefill_context_parallel_size", ("-pcp",), int, (1,), _NO_DCP),
    ("data_parallel_rank", ("-dpn",), int, (None, 0), _NO_DP),
    ("data_parallel_start_rank", ("-dpr",), int, (None, 0), _NO_DP),
    ("data_parallel_size_local", ("-dpl",), int, (None, 1), _ONE_ENGINE),
    ("data_parallel_address", ("-dpa",), str, (None,), _NO_DP),
    ("data_parallel_rpc_port", ("-dpp",), int, (None,), _NO_DP),
    ("data_parallel_backend", ("-dpb",), str, (None, "mp"), _NO_DP),
    ("data_parallel_hybrid_lb", ("-dph",), bool, (None, False), _NO_DP),
    ("data_parallel_external_lb", ("-dpe",), bool, (None, False), _NO_DP),
    ("data_parallel_multi_port_external_lb", ("-dpm",), bool, (None, False), _NO_DP),
    ("enable_batch_sharded_sampling", (), bool, (None, False), "each shard samples the whole batch itself"),
    ("enable_ep_weight_filter", (), bool, (None, False), _EXPERTS_TP),
    ("enable_hc_sp", (), bool, (False,), "no HyperConnection architecture is supported"),
    (
        "enable_shm_tensor_arena",
        (),
        bool,
        (False,),
        "a step's inputs reach the shards through Ray (no shared-memory arena)",
    ),
    ("dp_sync_interval", (), int, (16,), _NO_DP),
    ("all2all_backend", (), str, (None,), _EXPERTS_TP),
    ("enable_dbo", (), bool, (None, False), "a step runs as one batch (no dual-batch overlap)"),
    ("ubatch_size", (), int, (None, 0), "a step runs as one batch (no micro-batches)"),
    ("dbo_decode_token_threshold", (), int, (None,), "a step runs as one batch (no dual-batch overlap)"),
    ("dbo_prefill_token_threshold", (), int, (None,), "a step runs as one batch (no dual-batch overlap)"),
    ("enable_elastic_ep", (), bool, (None, False), _EXPERTS_TP),
    ("elastic_ep_max_dp_size", (), int, (None,), _EXPERTS_TP),
    ("enable_eplb", (), bool, (None, False), _EXPERTS_TP),
    ("eplb_config", (), str, (None,), _EXPERTS_TP),
    ("expert_placement_strategy", (), str, (None, "linear"), _EXPERTS_TP),
    ("ray_workers_use_nsight", (), bool, (None, False), _NO_TRACING),
    ("worker_cls", (), str, (None, "auto"), _NO_PLUGINS),
    ("worker_extension_cls", (), str, (None, ""), _NO_PLUGINS),
    (
        "enable_fault_tolerance",
        (),
        bool,
        (None, False),
        "a lost or stalled shard group is restarted and its requests recomputed by {enable_recovery} (on by default)",
    ),
    ("fault_tolerance_config", (), str, (None,), "shard recovery is {enable_recovery}'s (on by default)"),
    # cache
    ("prefix_cache_retention_interval", (), int, (None, 0), _NO_MAMBA),
    ("kv_cache_dtype_skip_layers", (), list, (None,), "{kv_cache_dtype} applies to every layer"),
    ("kv_sharing_fast_prefill", (), bool, (None, False), "every layer keeps its own KV cache"),
    (
        "enable_extensible_kv_cache",
        (),
        bool,
        (None, False),
        "the KV cache is sized once at startup, by {gpu_memory_utilization}'s profiling or {kv_cache_memory_bytes}",
    ),
    ("enable_mamba_shared_prefix_checkpoint", (), bool, (False,), _NO_MAMBA),
    ("mamba_cache_dtype", (), str, (None, "auto"), _NO_MAMBA),
    ("mamba_ssm_cache_dtype", (), str, (None, "auto"), _NO_MAMBA),
    ("mamba_block_size", (), int, (None,), _NO_MAMBA),
    ("mamba_cache_mode", (), str, (None, "none"), _NO_MAMBA),
    ("mamba_backend", (), str, (None, "triton"), _NO_MAMBA),
    ("mamba_ssu_algorithm", (), str, (None,), _NO_MAMBA),
    ("enable_mamba_cache_stochastic_rounding", (), bool, (None, False), _NO_MAMBA),
    ("mamba_cache_philox_rounds", (), int, (None, 0), _NO_MAMBA),
    ("replayssm_buffer_len", (), int, (None, 16), _NO_MAMBA),
    ("use_replayssm", (), bool, (None, False), _NO_MAMBA),
    ("prefix_match_unit", (), int, (None,), "prefix-cache hits are whole KV blocks ({block_size} tokens)"),
    ("kv_offloading_size", (), float, (None,), "preempted requests' KV blocks swap to CPU memory ({swap_space})"),
    ("kv_offloading_backend", (), str, (None, "native"), "preempted requests' KV blocks swap to CPU ({swap_space})"),
    # weights offload
    ("offload_backend", (), str, (None, "auto"), _NO_OFFLOAD),
    ("cpu_offload_params", (), list, (None,), _NO_OFFLOAD),
    ("offload_group_size", (), int, (None, 0), _NO_OFFLOAD),
    ("offload_num_in_group", (), int, (None, 1), _NO_OFFLOAD),
    ("offload_prefetch_step", (), int, (None, 1), _NO_OFFLOAD),
    ("offload_params", (), list, (None,), _NO_OFFLOAD),
    # multimodal
    ("enable_mm_embeds", (), bool, (None, False), _TEXT_ONLY),
    ("media_io_kwargs", (), str, (None, "{}"), _TEXT_ONLY),
    ("mm_processor_cache_gb", (), float, (None,), _TEXT_ONLY),
    ("mm_processor_cache_type", (), str, (None,), _TEXT_ONLY),
    ("mm_hasher_algorithm", (), str, (None,), _TEXT_ONLY),
    ("mm_shm_cache_max_object_size_mb", (), int, (None,), _TEXT_ONLY),
    ("mm_encoder_only", (), bool, (None, False), _TEXT_ONLY),
    ("mm_encoder_tp_mode", (), str, (None,), _TEXT_ONLY),
    ("mm_encoder_attn_backend", (), str, (None,), _TEXT_ONLY),
    ("mm_encoder_attn_dtype", (), str, (None,), _TEXT_ONLY),
    ("mm_encoder_fp8_scale_path", (), str, (None,), _TEXT_ONLY),
    ("mm_encoder_fp8_scale_save_path", (), str, (None,), _TEXT_ONLY),
    ("mm_encoder_fp8_scale_save_margin", (), float, (None,), _TEXT_ONLY),
    ("interleave_mm_strings", (), bool, (None, False), _TEXT_ONLY),
    ("video_pruning_rate", (), float, (None,), _TEXT_ONLY),
    ("video_pruning_method", (), str, (None,), _TEXT_ONLY),
    ("mm_tensor_ipc", (), str, (None,), _TEXT_ONLY),
    ("mm_processor_device", (), str, (None,), _TEXT_ONLY),
    ("mm_ipc_gpu_memory_gb", (), float, (None,), _TEXT_ONLY),
    ("mm_device_do_normalize", (), bool, (None,), _TEXT_ONLY),
    ("disable_chunked_mm_input", (), bool, (None, False), _TEXT_ONLY),
    ("enable_multimodal_encoder_data_parallel", (), bool, (None, False), _TEXT_ONLY),
    # LoRA
    ("lora_dtype", (), str, ("auto",), "adapters run in the base model's dtype (auto)"),
    ("fully_sharded_loras", (), bool, (None, False), "tensor parallelism shards A and B as their base linear"),
    ("lora_target_modules", (), list, (None,), "an adapter applies to every module its adapter_config.json names"),
    ("enable_tower_connector_lora", (), bool, (None, False), _TEXT_ONLY),
    ("default_mm_loras", (), str, (None,), _TEXT_ONLY),
    ("specialize_active_lora", (), bool, (None, False), "CUDA graphs record the LoRA path with a fixed slot count"),
    ("enable_mixed_moe_lora_format", (), bool, (None, False), _NO_EXPERT_LORA),
    ("enable_moe_shared_loras", (), bool, (None, False), _NO_EXPERT_LORA),
    ("max_lora_cls_labels", (), int, (None,), "raypaged serves generative models only (no classification heads)"),
    # observability
    ("otlp_traces_endpoint", (), str, (None,), _NO_TRACING),
    ("collect_detailed_traces", (), str, (None,), _NO_TRACING),
    ("token_level_profiling", (), bool, (None, False), _NO_TRACING),
    ("per_request_spec_decode_metrics", (), str, (None, "none"), "speculation counters are in /metrics"),
    ("kv_cache_metrics", (), bool, (None, False), "KV cache usage and prefix-cache hits are in /metrics"),
    ("kv_cache_metrics_sample", (), float, (None,), "KV cache usage and prefix-cache hits are in /metrics"),
    ("cudagraph_metrics", (), bool, (None, False), _NO_TRACING),
    ("enable_layerwise_nvtx_tracing", (), bool, (None, False), _NO_TRACING),
    ("enable_mfu_metrics", (), bool, (None, False), _NO_TRACING),
    ("enable_logging_iteration_details", (), bool, (None, False), "raypaged logs no periodic stats (see /metrics)"),
    ("jit_monitor_mode", (), str, (None, "warn"), "the model is not compiled with torch.compile"),
    ("jit_monitor_verbose", (), bool, (None, False), "the model is not compiled with torch.compile"),
    ("profiler_config", (), str, (None,), _NO_TRACING),
    ("aggregate_engine_logging", (), bool, (None, False), "raypaged logs no periodic stats (see /metrics)"),
    # scheduler
    (
        "max_num_scheduled_tokens",
        (),
        str,
        (None,),
        "a step schedules up to {max_num_batched_tokens} tokens: set that instead",
    ),
    ("scheduler_cls", (), str, (None,), _NO_PLUGINS),
    (
        "scheduler_reserve_full_isl",
        (),
        bool,
        (None, False),
        "a request is admitted when its first chunk's blocks fit; later chunks take blocks as they run",
    ),
    ("watermark", (), float, (None, 0.0), "requests are admitted while their next blocks fit (no reserve)"),
    ("cache_aware_admission_window", (), int, (0,), "waiting requests are admitted in {scheduling_policy}'s order"),
    ("max_num_inflight_kv_loads", (), int, (None,), "prefill and decode run in the same engine (no KV transfer)"),
    ("prefill_schedule_interval", (), int, (None, 1), "new prompts are admitted at every step"),
    ("disable_hybrid_kv_cache_manager", (), bool, (None, True), "every layer's KV cache is paged the same way"),
    ("performance_mode", (), str, (None, "balanced"), "set {max_num_seqs} and {max_num_batched_tokens} directly"),
    # kernels and other configs
    ("attention_config", ("-ac",), str, (None,), "choose attention with {attention_backend} (auto, torch, cpu, cuda)"),
    ("kernel_config", (), str, (None,), _KERNELS),
    ("ir_op_priority", (), str, (None,), _KERNELS),
    ("enable_flashinfer_autotune", (), bool, (None, False), "raypaged's kernels are chosen per device (no FlashInfer)"),
    ("monokernel", (), bool, (False,), _KERNELS),
    ("enable_bf16x3_router_gemm", (), bool, (None,), _TORCH_EXPERTS),
    ("moe_backend", (), str, (None, "auto"), _TORCH_EXPERTS),
    ("linear_backend", (), str, (None, "auto"), _KERNELS),
    ("sparse_indexer_topk_backend", (), str, ("auto",), "no sparse-attention (DSA) architecture is supported"),
    ("gdn_prefill_backend", (), str, (None,), "no linear-attention (GatedDeltaNet) architecture is supported"),
    ("kda_prefill_backend", (), str, (None,), "no linear-attention (KDA) architecture is supported"),
    ("kda_decode_backend", (), str, (None,), "no linear-attention (KDA) architecture is supported"),
    ("diffusion_config", ("-dc",), str, (None,), "raypaged serves autoregressive models only"),
    ("kv_transfer_config", (), str, (None,), "prefill and decode run in the same engine (no KV transfer)"),
    ("kv_events_config", (), str, (None,), "the engine publishes no KV-cache events"),
    ("ec_transfer_config", (), str, (None,), _TEXT_ONLY),
    ("ec_manager_config", (), str, (None,), _TEXT_ONLY),
    ("additional_config", (), str, (None, "{}"), "raypaged reads no platform-specific extras"),
    ("weight_transfer_config", (), str, (None,), "weights are loaded once at startup"),
    ("watermark_config", (), str, (None,), "generated text is not watermarked"),
    ("engram_config", (), str, (None,), "no Engram architecture is supported"),
    ("aux_output_config", (), str, (None,), _NO_ROUTED),
    (
        "watchdog_config",
        (),
        str,
        (None,),
        "no thread stacks are dumped: a stalled shard is found by the step timeout ($RAYPAGED_STEP_TIMEOUT_S) "
        "and its group restarted",
    ),
    ("fail_on_environ_validation", (), bool, (None, False), "raypaged reads no VLLM_* environment variables"),
]

# options taken at any value: (type; bool for a switch, why they change nothing here)
ANY_VALUE: dict[str, tuple[type, str]] = {
    "trust_remote_code": (bool, "only raypaged's built-in architectures run; an unknown one is an error at startup"),
    "disable_log_stats": (bool, "raypaged logs no periodic stats (see /metrics)"),
    "disable_custom_all_reduce": (bool, "tensor-parallel all-reduces are NCCL's: there is no custom all-reduce kernel"),
    "max_seq_len_to_capture": (int, "decode CUDA graphs cover every context up to {max_model_len}"),
    "code_revision": (str, "no model code runs: only raypaged's built-in architectures"),
    "max_parallel_loading_workers": (int, "each shard reads its own share of the checkpoint, tensor by tensor"),
    "disable_sliding_window": (
        bool,
        "attention always spans the whole context: a model's sliding window caps {max_model_len}, as this flag asks",
    ),
    "disable_cascade_attn": (bool, "attention has no cascade path: each sequence reads its own blocks"),
    "language_model_only": (bool, "the served models are language models only"),
    "allow_deprecated_quantization": (bool, "no supported quantization method is deprecated"),
    "show_hidden_metrics_for_version": (str, "raypaged hides no metric behind a version"),
    "skip_mm_profiling": (bool, _TEXT_ONLY),
    "swa_bounded_replay": (bool, "no supported architecture keeps a sliding-window KV cache apart"),
    "disable_nccl_for_dp_synchronization": (bool, "one engine per model: there are no data-parallel ranks to sync"),
    "cache_aware_admission_threshold": (float, "waiting requests are admitted in order: no cache-aware window engages"),
}

# gateway options (``raypaged serve`` and ``raypaged gateway``), as DEFAULT_ONLY
SERVER_DEFAULT_ONLY: list[Option] = [
    ("headless", (), bool, (False,), "the server always runs its HTTP API beside its engines"),
    ("headless_client_handshake_address", (), str, (None,), "the server always runs its HTTP API beside its engines"),
    ("api_server_count", ("-asc",), int, (None, 1), "one HTTP server process serves every model"),
    ("grpc", (), bool, (False,), "raypaged's gRPC API (its own protocol, not vLLM's) is `raypaged engine`"),
    ("data_parallel_supervisor_port", (), int, (None, 9256), _NO_DP),
    ("dp_supervisor_probe_interval_s", (), float, (None, 5.0), _NO_DP),
    ("dp_supervisor_probe_timeout_s", (), float, (None, 5.0), _NO_DP),
    ("dp_supervisor_probe_failure_threshold", (), int, (None, 3), _NO_DP),
    ("middleware", (), list, (None,), _NO_PLUGINS),
    ("tool_parser_plugin", (), str, (None, ""), "tool-call parsers are built in ({tool_call_parser})"),
    ("reasoning_parser_plugin", (), str, (None, ""), "reasoning parsers are built in ({reasoning_parser})"),
    ("tool_server", (), str, (None,), "no built-in (MCP) tools are served: function tools run on the client"),
    (
        "tool_strict_level",
        (),
        str,
        (None, "auto"),
        "tool calls of tool_choice auto are parsed from the model's text ({tool_call_parser}), not constrained; "
        "tool_choice required or a named function constrains the call and its arguments",
    ),
    ("enable_per_request_metrics", (), bool, (None, False), "request timings are /metrics histograms"),
    ("cohere_is_reasoning_model", (), bool, (None, True), "no Cohere endpoint is served"),
    ("cohere_format", (), str, (None, "cmd4"), "no Cohere endpoint is served"),
    (
        "tokens_only",
        (),
        bool,
        (None, False),
        "the OpenAI endpoints are served, and {enable_scale_out} adds /inference/v1/generate beside them",
    ),
    ("enable_ssl_refresh", (), bool, (None, False), "the TLS certificate and key are read once at startup"),
    ("enable_offline_docs", (), bool, (None, False), "no Swagger or ReDoc page is served (only /openapi.json)"),
]

SERVER_ANY_VALUE: dict[str, tuple[type, str]] = {
    "enable_flash_late_interaction": (bool, "no late-interaction scoring model is served"),
    "trust_request_mm_kwargs": (bool, f"{_TEXT_ONLY}: a request's mm_processor_kwargs and media_io_kwargs are refused"),
}

_SPEC = (
    'give the draft as --speculative-config JSON ({"method": "ngram" or "draft_model", "model": ..., '
    '"num_speculative_tokens": N, "prompt_lookup_max": N, ...})'
)
# flags that vLLM's older command lines carry and vLLM itself no longer takes: refused by name, with what replaced
# them (argparse alone would only call them unrecognized)
LEGACY_FLAGS: dict[str, str] = {
    "--num-scheduler-steps": "every step is scheduled (--async-scheduling overlaps scheduling with the step)",
    "--use-v2-block-manager": "the paged block manager is the only one",
    "--speculative-model": _SPEC,
    "--num-speculative-tokens": _SPEC,
    "--ngram-prompt-lookup-max": _SPEC,
    "--ngram-prompt-lookup-min": _SPEC,
    "--speculative-draft-tensor-parallel-size": _SPEC,
    "--speculative-max-model-len": _SPEC,
    "--speculative-disable-by-batch-size": _SPEC,
    "--enable-reasoning": "--reasoning-parser NAME alone separates the reasoning",
    "--disable-async-output-proc": "outputs are processed beside the step, with nothing to turn off",
    "--rope-scaling": "give it as --hf-overrides '{\"rope_scaling\": {...}}'",
    "--rope-theta": "give it as --hf-overrides '{\"rope_theta\": ...}'",
    "--tokenizer-pool-size": "prompts are tokenized on the server's own threads",
    "--worker-use-ray": "use --distributed-executor-backend ray",
    "--override-pooler-config": "use --pooler-config",
}
