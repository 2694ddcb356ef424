"""Embeddings offline: raypaged ``LLM.embed`` (``runner="pooling"``) against transformers' base model.

Every system embeds the same prompts (token ids drawn as W6's, lengths uniform 50-200) with SmolLM2 in fp32 and
the same threads, last-token pooling, L2-normalized; one timed run after a warm-up each. Peers: transformers'
``AutoModel`` in padded batches of 16 in the given order, and sorted by length first (what sentence-transformers'
``encode`` does). The vectors of every system are compared with raypaged's. ``--encoder``: a BERT-base-shaped
encoder (12 layers of 768, random weights, its first token's state pooled) in place of SmolLM2, the shape of the
most used embedding models (bge-base, e5-base, all-mpnet).

    python benchmarks/embed_bench.py --quick
    python benchmarks/embed_bench.py --quick --encoder
    python benchmarks/embed_bench.py --num-prompts 512
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import build_prompts, load_average, machine_info, write_json

from raypaged.model.default_model import default_model_dir

Prompts = list[list[int]]
BATCH = 16


def bench_raypaged(model_dir: Path, prompts: Prompts, warm_up: Prompts) -> tuple[float, torch.Tensor]:
    """``warm_up`` are other prompts: the timed ones must not find their prefixes cached."""
    from raypaged import LLM

    llm = LLM(model=str(model_dir), runner="pooling", device="cpu", max_model_len=512)
    try:
        llm.embed([{"prompt_token_ids": p} for p in warm_up], use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return seconds, torch.tensor([o.outputs.embedding for o in outputs])


def hf_embed(model: torch.nn.Module, batch: Prompts) -> torch.Tensor:
    """A padded batch (right padding, attention mask) through the base model: each prompt's last token (an encoder's
    first), normalized."""
    lengths = torch.tensor([len(p) for p in batch])
    ids = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, : len(prompt)] = torch.tensor(prompt)
        mask[row, : len(prompt)] = 1
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    rows = torch.zeros_like(lengths) if model.config.model_type == "bert" else lengths - 1
    return torch.nn.functional.normalize(hidden[torch.arange(len(batch)), rows], dim=-1)


def bench_hf(model_dir: Path, prompts: Prompts, sort: bool) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if sort else list(range(len(prompts)))
    hf_embed(model, prompts[:BATCH])  # warm-up (transformers caches nothing between calls)
    start = time.perf_counter()
    vectors = torch.empty(len(prompts), model.config.hidden_size)
    for first in range(0, len(order), BATCH):
        rows = order[first : first + BATCH]
        vectors[rows] = hf_embed(model, [prompts[i] for i in rows])
    return time.perf_counter() - start, vectors


BERT_VOCAB = 30522


def bert_base(path: Path, seed: int) -> Path:
    """A BERT-base-shaped ``BertModel`` with random weights, saved at ``path`` (raypaged pools its CLS token)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=BERT_VOCAB, architectures=["BertModel"])
    BertModel(config).save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # a tokenizer of the vocabulary's size (the prompts are token ids: its words are placeholders)
    words = ["[PAD]", "[UNK]", *(f"w{i}" for i in range(2, BERT_VOCAB))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="64 prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--encoder", action="store_true", help="a BERT-base-shaped encoder in place of SmolLM2")
    args = parser.parse_args()
    count = 64 if args.quick else args.num_prompts
    model_dir = default_model_dir()
    prompts = build_prompts(model_dir, count, args.seed)
    warm_up = build_prompts(model_dir, BATCH, args.seed + 1)
    model_name = "SmolLM2-135M"
    if args.encoder:
        model_dir, model_name = bert_base(Path(tempfile.mkdtemp(prefix="bert-base-")), args.seed), "BERT-base shape"
        prompts, warm_up = ([[t % BERT_VOCAB for t in p] for p in batch] for batch in (prompts, warm_up))
    num_tokens = sum(map(len, prompts))
    systems = {
        "raypaged LLM.embed": lambda: bench_raypaged(model_dir, prompts, warm_up),
        f"transformers AutoModel, batches of {BATCH}": lambda: bench_hf(model_dir, prompts, sort=False),
        f"transformers AutoModel, batches of {BATCH} sorted by length": lambda: bench_hf(model_dir, prompts, sort=True),
    }
    results = []
    reference: torch.Tensor | None = None
    for name, run in systems.items():
        seconds, vectors = run()
        reference = vectors if reference is None else reference
        results.append(
            {
                "system": name,
                "seconds": round(seconds, 3),
                "prompt_tokens_per_s": round(num_tokens / seconds, 1),
                "embeddings_per_s": round(count / seconds, 2),
                "max_abs_diff_vs_raypaged": float((vectors - reference).abs().max()),
            }
        )
    base = results[0]["prompt_tokens_per_s"]
    print(f"{count} prompts, {num_tokens} tokens, {model_name} fp32, {torch.get_num_threads()} threads")
    print("| system | seconds | prompt tokens/s | embeddings/s | raypaged ÷ this | max |Δ| vs raypaged |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        ratio = base / r["prompt_tokens_per_s"]
        print(
            f"| {r['system']} | {r['seconds']} | {r['prompt_tokens_per_s']} | {r['embeddings_per_s']} | "
            f"{ratio:.2f} | {r['max_abs_diff_vs_raypaged']:.1e} |"
        )
    report = {
        "workload": {
            "model": model_name,
            "prompts": count,
            "prompt_tokens": num_tokens,
            "lengths": "uniform 50-200",
            "seed": args.seed,
        },
        "machine": machine_info(torch.get_num_threads()),
        "load_average": load_average(),
        "results": results,
    }
    print(f"wrote {write_json('embed_bench_encoder' if args.encoder else 'embed_bench', report)}")


if __name__ == "__main__":
    main()
