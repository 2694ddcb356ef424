"""One model shard: weights, KV cache and the model runner."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from raypaged import envs
from raypaged.attention.backend import cuda_cache_unsupported_reason, select_backend
from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.config import DEFAULT_CPU_KV_CACHE_SPACE_GIB, EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.model.architecture import attention_backends, torch_attention_reason
from raypaged.model.layers import bf16_linears_on_cpu
from raypaged.model.llama import LlamaForCausalLM, cache_head_dim, num_kv_heads_per_rank
from raypaged.model.loader import load_image_encoder, load_model
from raypaged.model.parallel import TensorParallel
from raypaged.worker.cache import KVCache
from raypaged.worker.host_memory import retain_freed_memory
from raypaged.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from raypaged.lora.manager import LoRAManager

logger = logging.getLogger("raypaged")

_GIB = 1 << 30
_COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class Worker:
    """Rank ``tp.rank`` of a shard group: with ``tp.size > 1`` it first joins the group's
    torch.distributed process group at ``init_method`` (gloo on CPU, NCCL on CUDA). With pipeline
    parallelism (``tp.pp``) the process group holds every stage's ranks, and each stage's ranks get a group of
    their own for their collectives."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_id: int | None,
        tp: TensorParallel = TensorParallel(),
        init_method: str | None = None,
    ) -> None:
        self.config = config
        tp = self.tp = dataclasses.replace(tp, expert_parallel=config.enable_expert_parallel)
        self.device = torch.device(config.resolved_device)
        self.dtype = getattr(torch, config.resolved_dtype)
        self.cache_dtype = getattr(torch, config.resolved_kv_cache_dtype)
        # a bf16 decoder on a CPU (its experts too) computes in fp32 from bf16 weights in its float linears, over a
        # bf16 KV cache (--kv-cache-dtype auto) that the CPU kernels widen as they read it; it is built and loaded in
        # bf16, so it never takes fp32's memory. Encoders stay bf16 throughout, and so does a model whose attention
        # backend is named as another than the CPU kernels (torch's, or the CUDA kernels' host build)
        self.bf16_linears = (
            bf16_linears_on_cpu(self.dtype, self.device)
            and config.attention_backend in ("auto", "cpu")
            and not config.encoder
        )
        if self.bf16_linears:
            self.dtype = torch.float32
        self.eos_token_id = eos_token_id
        pp = tp.pp
        if tp.size * pp.size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=pp.global_rank(tp.rank),
                world_size=tp.size * pp.size,
                timeout=_COLLECTIVE_TIMEOUT,
            )
        if pp.size > 1:  # every rank makes every stage's group, in the same order
            groups = [dist.new_group([pp.global_rank(r, stage) for r in range(tp.size)]) for stage in range(pp.size)]
            tp = self.tp = dataclasses.replace(tp, group=groups[pp.index])
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index if self.device.index is not None else 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
            if tp.size > 1 and pp.size == 1 and envs.tp_cuda_graphs() and not config.enforce_eager:
                from raypaged.worker.nccl import NcclAllReduce

                tp.comm.all_reduce = NcclAllReduce(tp)  # every rank builds it here, together
            # what this process held before this worker: other engines' memory is not this worker's footprint
            self._torch_baseline = torch.cuda.memory_allocated(self.device)
            self._outside_baseline = self._memory_outside_torch()
        else:  # a step's activations stay in the heap for the next step instead of being faulted in anew
            retain_freed_memory()
        self.model = load_model(
            config.model_path,
            config.hf_config,
            config.resolved_max_model_len,
            self.dtype,
            self.device,
            tp,
            config.load_format,
            config.seed,
            config.quant_config,
            head=config.pooler is None,
            num_labels=0 if config.pooler is None else len(config.pooler.labels),
            bf16_linears=self.bf16_linears,
        )
        self.image_encoder = None  # an image-text model's vision tower and projector (LlavaImageEncoder)
        if config.image_hf_config is not None and tp.pp.first:  # images enter at the first pipeline stage
            self.image_encoder = load_image_encoder(
                config.model_path,
                config.image_hf_config,
                self.dtype,
                self.device,
                config.load_format,
                config.seed,
                self.bf16_linears,
            )
        # the CUDA kernels read a cache of the model's dtype, and an fp8 e4m3 one with $RAYPAGED_FP8_KV_KERNELS=1: for
        # any other an fp8 cache is read and written in torch (the CPU kernels read and write an fp8 e4m3 cache
        # themselves; select_backend says when they cannot)
        backend = config.attention_backend
        if self.device.type == "cuda" and cuda_cache_unsupported_reason(self.dtype, self.cache_dtype) is not None:
            backend = "torch"
            logger.info(
                "--kv-cache-dtype %s: paged attention runs in torch, not the CUDA kernels", config.kv_cache_dtype
            )
        head_dim = cache_head_dim(config.hf_config)
        self.attn_backend = select_backend(
            backend, self.device, head_dim, config.block_size, self.dtype, self.cache_dtype
        )
        allowed = attention_backends(config.hf_config)
        if allowed is not None and self.attn_backend.name not in allowed:  # auto chose kernels that cannot run it
            logger.info("paged attention runs in torch: %s", torch_attention_reason(config.hf_config))
            self.attn_backend = select_backend(
                "torch", self.device, head_dim, config.block_size, self.dtype, self.cache_dtype
            )
        self.model.set_attention_backend(self.attn_backend)
        self._check_kv_scales()
        self.lora: LoRAManager | None = None  # LoRA slots wrap the loaded model's linears
        if (lora_config := config.lora_config) is not None:
            from raypaged.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, lora_config, tp, self.dtype, self.device)
        self.runner: ModelRunner | None = None
        self.draft_model: torch.nn.Module | None = None  # speculative decoding's draft model, beside the model
        if config.draft_model_path is not None:
            self.draft_model = load_model(
                config.draft_model_path,
                config.draft_hf_config,
                config.resolved_max_model_len,
                self.dtype,
                self.device,
                tp,
                config.load_format,
                config.seed,
                bf16_linears=self.bf16_linears,
            )
            self.draft_backend = select_backend(
                config.attention_backend,
                self.device,
                cache_head_dim(config.draft_hf_config),
                config.block_size,
                self.dtype,
            )
            self.draft_model.set_attention_backend(self.draft_backend)
            if self.draft_model.checkpoint_kv_scales:  # its cache is the model's dtype
                _drop_kv_scales(self.draft_model, self.dtype)

    @property
    def num_layers(self) -> int:
        """The layers this shard runs (and caches K/V for): all of them, or its pipeline stage's."""
        return len(self.tp.pp.layers(self.config.hf_config.num_hidden_layers))

    def block_shape(self) -> tuple[int, int, int]:
        """One layer's K (or V) block on this rank: (kv_heads, block_size, head_dim); an encoder's hold nothing (it
        keeps no KV cache: its blocks are only the scheduler's count of the tokens in flight)."""
        hf = self.config.hf_config
        head_dim = 0 if self.config.encoder else cache_head_dim(hf)
        return num_kv_heads_per_rank(hf, self.tp.size), self.config.block_size, head_dim

    def draft_block_shape(self) -> tuple[int, int, int]:
        """One layer's K (or V) block of the draft model (it runs unsharded)."""
        draft = self.config.draft_hf_config
        return num_kv_heads_per_rank(draft, 1), self.config.block_size, cache_head_dim(draft)

    def bytes_per_block(self) -> int:
        """A block's bytes over every layer, the draft model's included."""
        elem = torch.tensor([], dtype=self.cache_dtype).element_size()
        total = 2 * self.num_layers * math.prod(self.block_shape()) * elem
        if self.draft_model is not None:
            assert self.config.draft_hf_config is not None  # resolved with the draft model's path
            draft_elem = torch.tensor([], dtype=self.dtype).element_size()
            total += (
                2 * self.config.draft_hf_config.num_hidden_layers * math.prod(self.draft_block_shape()) * draft_elem
            )
        return total

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) this worker can hold.

        ``kv_cache_memory_bytes`` bytes of blocks where it is given (vLLM's, on any device); else on CUDA the
        device blocks fill what ``gpu_memory_utilization`` of the device leaves after the weights, the peak
        activations of a profiled worst-case step, and memory held outside torch (cupy, NCCL, the CUDA
        context); on CPU ``kv_cache_space`` GiB (else ``$RAYPAGED_CPU_KVCACHE_SPACE``, else 4).
        """
        if self.config.encoder:  # no cache: as many blocks as a full batch of the longest prompts takes
            config = self.config
            per_seq = -(-config.resolved_max_model_len // config.block_size)
            return config.num_gpu_blocks_override or per_seq * config.max_num_seqs, 0
        per_block = self.bytes_per_block()
        num_cpu_blocks = int(self.config.resolved_swap_space * _GIB) // per_block
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override, num_cpu_blocks
        if (kv_bytes := self.config.kv_cache_memory_bytes) is not None:
            if kv_bytes < per_block:
                raise ValueError(
                    f"--kv-cache-memory-bytes {kv_bytes} is less than one KV block ({per_block} bytes: "
                    f"{self.config.block_size} tokens of every layer's K and V)"
                )
            return kv_bytes // per_block, num_cpu_blocks
        if self.device.type == "cuda":
            kv_bytes = self.profile_free_device_memory()
            if kv_bytes < per_block:
                raise ValueError(
                    f"no device memory is left for the KV cache: gpu_memory_utilization "
                    f"{self.config.gpu_memory_utilization} of the device is used by the weights and activations "
                    f"(raise --gpu-memory-utilization, or lower --max-num-batched-tokens)"
                )
            return kv_bytes // per_block, num_cpu_blocks
        space = self.config.kv_cache_space or envs.cpu_kv_cache_space() or DEFAULT_CPU_KV_CACHE_SPACE_GIB
        return max(1, int(space * _GIB) // per_block), num_cpu_blocks

    @torch.inference_mode()
    def profile_free_device_memory(self) -> int:
        """Bytes the KV cache may take: run the largest step the scheduler can send (a
        ``max_num_batched_tokens`` prefill split into up to ``max_num_seqs`` prompts, logits
        for each) and see how much memory it peaked at."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(
            self.config.resolved_max_num_batched_tokens, self.config.max_num_seqs * self.config.resolved_max_model_len
        )
        num_seqs = min(self.config.max_num_seqs, num_tokens)
        # a one-block cache: every slot is -1 (nothing written), every span a whole prompt (nothing read)
        block = torch.zeros((1, *self.block_shape()), dtype=self.cache_dtype, device=self.device)
        layers = [(block, block)] * self.num_layers
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        starts = [0, *itertools.accumulate(lengths[:-1])]
        no_blocks = torch.zeros(0, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros((0, 0), dtype=torch.long, device=self.device),
            decode_context_lens=no_blocks,
            prefills=[PrefillSpan(start, n, n, no_blocks) for start, n in zip(starts, lengths)],
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        hidden = self.model(input_ids, positions, layers, meta)
        last = torch.tensor([s + n - 1 for s, n in zip(starts, lengths)], device=self.device)
        if self.model.has_head and self.tp.pp.last:  # an embedding model's step ends with its hidden states
            self.model.compute_logits(hidden[last]).float().log_softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._torch_baseline
        outside_torch = max(0, self._memory_outside_torch() - self._outside_baseline)  # cupy modules, cuBLAS, NCCL
        del hidden, layers, block
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - outside_torch
        budget = min(budget, free - (256 << 20))  # never more than is free now (other processes, other engines)
        logger.info(
            "device memory: %.2f GiB total, %.2f GiB peak in torch (weights + a %d-token step), %.2f GiB outside "
            "torch: %.2f GiB for the KV cache at gpu_memory_utilization %.2f",
            total / _GIB,
            peak / _GIB,
            num_tokens,
            outside_torch / _GIB,
            max(0, budget) / _GIB,
            self.config.gpu_memory_utilization,
        )
        return max(0, budget)

    def _memory_outside_torch(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) - torch.cuda.memory_reserved(self.device)

    def _check_kv_scales(self) -> None:
        """An fp8 cache takes the checkpoint's K/V scales (or, with --calculate-kv-scales, the first step's); a
        cache of the model's dtype none, as vLLM: the checkpoint's are then set back to 1.0, and the log says so."""
        from_checkpoint = self.model.checkpoint_kv_scales
        if self.cache_dtype.itemsize != 1:
            if from_checkpoint:
                _drop_kv_scales(self.model, self.cache_dtype)
        elif self.config.calculate_kv_scales:
            logger.info(
                "fp8 KV cache: each layer's K/V scales come from the first step's keys and values%s",
                " (in place of the checkpoint's)" if from_checkpoint else "",
            )
        elif from_checkpoint:
            logger.info("fp8 KV cache: each layer's K/V scaled by the checkpoint's k_scale and v_scale")
        else:
            logger.warning(
                "fp8 KV cache with K/V scales of 1.0 (the checkpoint has none): values beyond fp8's range (448) are "
                "clamped and small ones lose precision; --calculate-kv-scales sets them from the first step"
            )

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        cache = KVCache(
            self.num_layers,
            num_blocks,
            num_cpu_blocks,
            self.block_shape(),
            self.cache_dtype,
            self.device,
            use_kernels=self.attn_backend.name == "cuda",
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB), %d CPU swap blocks",
            num_blocks,
            self.config.block_size,
            num_blocks * self.bytes_per_block() / _GIB,
            num_cpu_blocks,
        )
        self.runner = ModelRunner(
            self.model,
            cache,
            self.config.block_size,
            self.eos_token_id,
            self.config.seed,
            self.device,
            samples=self.tp.rank == 0 and self.tp.pp.last,
            last_stage=self.tp.pp.last,
            first_stage=self.tp.pp.first,
            reports_inputs=self.tp.rank == 0 and self.tp.pp.first,
            lora=self.lora,
            async_scheduling=self.config.resolved_async_scheduling,
            logprobs_mode=self.config.logprobs_mode,
            pooling_type=None if self.config.pooler is None else self.config.pooler.pooling_type,
            image_encoder=self.image_encoder,
        )
        if self.draft_model is not None:
            from raypaged.spec_decode.draft_model import DraftModelProposer

            # resolved with the draft model's path: a parsed config of method draft_model
            spec = self.config.parsed_speculative_config
            assert spec is not None and self.config.draft_hf_config is not None
            draft_cache = KVCache(
                self.config.draft_hf_config.num_hidden_layers,
                num_blocks,
                num_cpu_blocks,
                self.draft_block_shape(),
                self.dtype,
                self.device,
                use_kernels=self.draft_backend.name == "cuda",
            )
            self.runner.drafter = DraftModelProposer(
                self.draft_model,
                draft_cache,
                self.config.block_size,
                spec.num_speculative_tokens,
                self.config.resolved_max_model_len,
                self.device,
            )
        if self.config.calculate_kv_scales:  # from the first step with tokens: the profile runs are behind
            self.model.calculate_kv_scales_next_step()
        if self.device.type == "cuda" and not self.config.enforce_eager:
            if self.tp.pp.size > 1:
                logger.info("CUDA graphs are off under pipeline parallelism; steps run eagerly")
            elif self.tp.size > 1 and self.tp.comm.all_reduce is None:
                logger.info(
                    "CUDA graphs are off under tensor parallelism (RAYPAGED_TP_CUDA_GRAPHS=1 turns them on); decode "
                    "steps run eagerly"
                )
            elif self.config.calculate_kv_scales:  # a graph would keep the scales of its capture, 1.0
                logger.info("CUDA graphs are off with --calculate-kv-scales; decode steps run eagerly")
            elif self.config.pooler is not None:  # no decode step: every request ends with its prefill
                logger.info("CUDA graphs are off for embedding models (every step is a prefill); steps run eagerly")
            elif self.model.architecture.moe is not None:  # each step sizes its experts' runs on the host
                logger.info("CUDA graphs are off for mixture-of-experts models; steps run eagerly")
            elif self.attn_backend.name != "cuda":  # torch's reshape_and_cache syncs, which capture forbids
                logger.info("CUDA graphs need the cuda attention backend; decode steps run eagerly")
            else:
                decode_sizes, token_buckets = self.config.cuda_graph_sizes
                self.runner.capture_decode_graphs(decode_sizes, self.config.resolved_max_model_len, token_buckets)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_cache makes the runner"
        return self.runner.execute_model(scheduler_output)


def _drop_kv_scales(model: LlamaForCausalLM, cache_dtype: torch.dtype) -> None:
    """A checkpoint's K/V scales set back to 1.0 over a cache that is not fp8 (vLLM does the same), said in the log."""
    logger.info(
        "the checkpoint's KV cache scales apply to an fp8 KV cache (--kv-cache-dtype fp8); this cache is %s, which "
        "stores K/V as they are",
        str(cache_dtype).removeprefix("torch."),
    )
    for scales in model.kv_scales():
        scales.set(1.0, 1.0)
