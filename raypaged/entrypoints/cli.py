"""``raypaged`` command line (vLLM flag names)."""

from __future__ import annotations

import argparse
import logging
import sys

from raypaged import envs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="auto, half, float16, bfloat16, float, float32")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    parser.add_argument("--kv-cache-space", type=float, default=None, help="GiB of KV cache on CPU (default 4)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact number of KV blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--log-level", default=envs.log_level(), choices=["debug", "info", "warning", "error"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_space=args.kv_cache_space,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        seed=args.seed,
        device=args.device,
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("raypaged").setLevel(level.upper())


def cmd_generate(args: argparse.Namespace) -> int:
    from raypaged import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"### prompt: {prompt}\n{completion.text}\n### {len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypaged", description="PagedAttention LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for prompts given as flags or on stdin")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per stdin line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
