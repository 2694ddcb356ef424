"""Multi-LoRA serving cost (CPU, SmolLM2-135M fp32): one engine, the same batch of requests run on the
base model alone and spread over 1, 4 and 16 LoRA adapters with ``--max-loras 4``, in one run.

Each round queues ``--requests`` greedy requests (prompts of 50-200 random ordinary tokens,
``--max-tokens`` each, EOS ignored) and steps the engine until all finish; tokens/s counts
generated tokens. Adapters are made with ``peft`` (rank 8 on every projection, random A and B).
With 16 adapters over 4 slots, requests of adapters without a slot wait while the others run.
Reported: tokens/s of each setting, its ratio to the base model, and the LoRA share of the step
(1 - ratio). The engines are built once per setting; the first round of each is a warm-up.

The peer, in the same run: ``peft``'s mixed-adapter batch inference on the same requests
(one ``PeftModel`` holding every adapter, ``generate(..., adapter_names=[...])`` with one name
per row; one static batch, prompts left-padded, as many greedy tokens per request; the
plain model for the base setting), what a team without a serving engine runs; its first
round is a warm-up too. Skipped with ``--no-peer``.

    python benchmarks/lora_bench.py           # 48 requests x 32 tokens, 2 measured rounds
    python benchmarks/lora_bench.py --quick   # 24 requests x 16 tokens, 1 measured round
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import CONTENTION_NOTE, RESULTS_DIR, build_prompts, load_average, machine_info, pyplot, write_json

from raypaged.config import EngineConfig
from raypaged.engine.llm_engine import LLMEngine
from raypaged.lora.request import LoRARequest
from raypaged.model.default_model import default_model_dir
from raypaged.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.lora.conftest import make_peft_adapter  # noqa: E402

SETTINGS = (0, 1, 4, 16)  # adapters in the mix (0: the base model alone)
MAX_LORAS = 4


def run_round(engine: LLMEngine, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for prompt, lora in zip(prompts, loras):
        engine.add_request(None, params, prompt_token_ids=prompt, lora_request=lora)
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
    return generated / (time.perf_counter() - start)


def peft_round(model_dir: Path, adapters: list[LoRARequest], prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens/s of one static mixed-adapter batch through peft (the base model alone without adapters)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = None
    if adapters:
        model = PeftModel.from_pretrained(model, adapters[0].lora_path, adapter_name=adapters[0].lora_name)
        for adapter in adapters[1:]:
            model.load_adapter(adapter.lora_path, adapter_name=adapter.lora_name)
        names = [adapters[i % len(adapters)].lora_name for i in range(len(prompts))]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = {"adapter_names": names} if names else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **options,
        )
    seconds = time.perf_counter() - start
    assert out.shape == (len(prompts), width + max_tokens)
    return len(prompts) * max_tokens / seconds


def plot(report: dict, path: Path) -> None:
    """Tokens/s by adapters in the batch: raypaged beside peft's mixed batch where it ran."""
    plt = pyplot()
    settings = list(report["settings"])
    labels = [
        "base" if key == "0" else f"{key}" + (f" over {MAX_LORAS} slots" if int(key) > MAX_LORAS else "")
        for key in settings
    ]
    ours = [report["settings"][key]["tokens_per_s"] for key in settings]
    peft = [report["settings"][key].get("peft_tokens_per_s") for key in settings]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(settings))
    width = 0.38 if any(peft) else 0.6
    ours_at = [x - width / 2 for x in xs] if any(peft) else list(xs)  # beside peft's bars, or centred alone
    ax.bar(ours_at, ours, width, label="raypaged", color="tab:green")
    if any(peft):
        ax.bar([x + width / 2 for x in xs], [p or 0 for p in peft], width, label="peft mixed batch", color="tab:gray")
    for x, value in zip(ours_at, ours):
        ax.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("adapters in the batch")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(
        f"SmolLM2-135M fp32, {report['requests']} requests x {report['max_tokens']} tokens, {report['machine']['cpu']}",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="skip peft's mixed-adapter generate")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_requests = args.requests or (24 if args.quick else 48)
    max_tokens = args.max_tokens or (16 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 2)
    model_dir = default_model_dir()
    prompts = build_prompts(model_dir, num_requests, seed=0)
    report: dict = {
        "machine": machine_info(args.threads),
        "load_average_start": load_average(),
        "note": CONTENTION_NOTE,
        "model": model_dir.name,
        "requests": num_requests,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "max_loras": MAX_LORAS,
        "settings": {},
    }
    with tempfile.TemporaryDirectory() as root:
        adapters = [
            LoRARequest(
                f"a{i}",
                i + 1,
                str(
                    make_peft_adapter(
                        model_dir, Path(root) / f"a{i}", i, r=8, lora_alpha=16, target_modules="all-linear"
                    )
                ),
            )
            for i in range(max(SETTINGS))
        ]
        for num_adapters in SETTINGS:
            engine = LLMEngine(
                EngineConfig(
                    model=str(model_dir),
                    dtype="float32",
                    max_model_len=512,
                    num_gpu_blocks_override=1024,
                    enable_lora=num_adapters > 0,
                    max_loras=MAX_LORAS,
                    max_lora_rank=8,
                )
            )
            loras = [adapters[i % num_adapters] if num_adapters else None for i in range(num_requests)]
            run_round(engine, prompts, loras, max_tokens)  # warm-up (adapters read and checked)
            rates = [run_round(engine, prompts, loras, max_tokens) for _ in range(rounds)]
            report["settings"][str(num_adapters)] = {"tokens_per_s": sum(rates) / len(rates), "rounds": rates}
            print(f"{num_adapters:2d} adapters: {sum(rates) / len(rates):7.1f} tokens/s", flush=True)
            engine.shutdown()
            if not args.no_peer:
                peer = [peft_round(model_dir, adapters[:num_adapters], prompts, max_tokens) for _ in range(rounds + 1)][
                    1:
                ]
                entry = report["settings"][str(num_adapters)]
                entry["peft_tokens_per_s"] = sum(peer) / len(peer)
                entry["raypaged_over_peft"] = entry["tokens_per_s"] / entry["peft_tokens_per_s"]
                print(
                    f"{num_adapters:2d} adapters, peft mixed batch: {entry['peft_tokens_per_s']:7.1f} tokens/s "
                    f"(raypaged {entry['raypaged_over_peft']:.2f}x)",
                    flush=True,
                )
    base = report["settings"]["0"]["tokens_per_s"]
    for key, entry in report["settings"].items():
        entry["ratio_to_base"] = entry["tokens_per_s"] / base
        entry["lora_share"] = 1 - entry["ratio_to_base"]
        if key != "0":
            print(
                f"{key:>2} adapters over {MAX_LORAS} slots: {entry['ratio_to_base']:.2f}x the base model "
                f"(LoRA share of the step {entry['lora_share']:.0%})"
            )
    report["load_average_end"] = load_average()
    plot(report, RESULTS_DIR / "lora_bench.png")
    print(f"wrote {write_json('lora_bench', report)} and lora_bench.png")


if __name__ == "__main__":
    main()
