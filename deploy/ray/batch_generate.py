"""Offline batch generation on a Ray cluster: prompts JSONL in, outputs JSONL out.

Each input line is ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``, with an
optional ``"id"`` (default: the line number). Each output line, in input order:
``{"id", "prompt", "text", "token_ids", "finish_reason"}``. Submit it with
``submit_batch.sh``, or run it anywhere that can reach the cluster:

    python deploy/ray/batch_generate.py --input prompts.jsonl --output outputs.jsonl \\
        --ray-address auto --tensor-parallel-size 2

It takes every engine flag ``raypaged generate`` takes (``--max-model-len``, ``--quantization`` ...);
``--seed`` seeds the sampling too.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

from raypaged import LLM, SamplingParams
from raypaged.entrypoints.cli import add_engine_args, engine_kwargs, setup_logging


def read_prompts(path: Path) -> tuple[list[str], list[dict]]:
    ids, prompts = [], []
    for number, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        record = json.loads(line)
        ids.append(str(record.get("id", number)))
        prompt = {k: record[k] for k in ("prompt", "prompt_token_ids") if k in record}
        if not prompt:
            raise ValueError(f"{path}:{number + 1}: a line needs prompt or prompt_token_ids")
        prompts.append(prompt)
    return ids, prompts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="prompts, one JSON object a line")
    parser.add_argument("--output", type=Path, required=True, help="where the outputs JSONL is written")
    add_engine_args(parser)  # every engine flag of `raypaged generate`, from EngineConfig's fields
    parser.set_defaults(ray_address="auto")  # a job joins the cluster it runs on
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    setup_logging(args)  # --log-level and --logging-config, as raypaged's commands

    ids, prompts = read_prompts(args.input)
    llm = LLM(**engine_kwargs(args, set(inspect.signature(LLM).parameters), args.model))
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as out:
        for request_id, output in zip(ids, outputs):
            completion = output.outputs[0]
            record = {
                "id": request_id,
                "prompt": output.prompt,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
            }
            out.write(json.dumps(record) + "\n")
    print(f"wrote {len(outputs)} outputs to {args.output}")


if __name__ == "__main__":
    main()
