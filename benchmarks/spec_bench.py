"""Speculative decoding (CPU, SmolLM2-135M-Instruct fp32): tokens/s with and without speculation.

Two engines on the default model, built once each in one process: one without speculation, one with
``--speculative-config`` (ngram prompt lookup by default: 4 drafts, lookup of 4 down to 2 tokens;
``--method draft_model --draft-model PATH`` for a draft model). Both run the same greedy requests,
rendered with the model's chat template:

- ``repetitive``: 4 "repeat this passage, changing only X to Y" requests and 4 "rename / document
  this code and reply with the whole code" requests; the replies copy much of the prompt.
- ``open_ended``: 8 open-ended writing requests; the replies copy little of the prompt (though a
  135M model's greedy replies drift into repeating their own sentences, which ngram lookup finds).

Each workload runs at batch 1 (its 8 prompts one ``generate`` call at a time) and at batch 8 (the 8
prompts in one call), ``--max-tokens`` each (EOS ends a reply early: both engines produce the same
tokens, so they count the same). A warm-up round (8 tokens, every workload and batch, which also fills
both prefix caches) comes first; each measured round then runs every (workload, batch) on both
engines, alternating generate call by generate call (at batch 1: prompt by prompt), which engine goes
first alternating too, so that a slow spell of a shared machine falls on both. Reported per
(workload, batch): tokens/s of both, the ratio, the acceptance rate (accepted / draft tokens),
accepted drafts per verification (a verification: one sequence's step that checked at least one
draft), the share of verifications that accepted the draft of each position, and whether every
reply is token-for-token the same with and without speculation (greedy). Goals: >= 1.8x on the
repetitive workload at batch 1, >= 0.95x on the open-ended one.

The peer (on by default, ``--no-peer`` skips it): Hugging Face transformers on the same model folder
(``AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)``, its default attention), plain greedy
``generate`` and its prompt-lookup decoding (``prompt_lookup_num_tokens=4, max_matching_ngram_size=4``),
at batch 1 only (transformers' prompt lookup takes one sequence), on the same chat-templated prompt token
ids, ``max_new_tokens`` = ``--max-tokens``, stopping at the same EOS ids as raypaged (the EOS counted as a
generated token, as raypaged's replies hold it). Its two runs join the batch-1 alternation of the first
``--peer-rounds`` rounds (2 by default), so the raypaged-ngram / transformers-prompt-lookup ratio compares
calls taken side by side; each peer reply is checked token for token against raypaged's (greedy; fp32
differences between the two implementations can flip a late token: counted, not failed).

    python benchmarks/spec_bench.py           # 128 tokens, 3 measured rounds, peer in 2 (about 11 minutes, 1 thread)
    python benchmarks/spec_bench.py --quick   # 32 tokens, 1 measured round (about 2 minutes)
    python benchmarks/spec_bench.py --no-peer # without transformers (about 6 minutes)
    python benchmarks/spec_bench.py --method draft_model --draft-model /path/to/small-model
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from common import CONTENTION_NOTE, RESULTS_DIR, Log, load_average, machine_info, write_json

from raypaged import LLM, SamplingParams
from raypaged.inputs.chat_template import render_chat
from raypaged.model.default_model import default_model_dir

BATCHES = (1, 8)
PEER_LOOKUP = {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 4}  # transformers' prompt lookup
PEERS = ("hf_plain", "hf_lookup")
MAX_MODEL_LEN = 2048
GOALS = {"repetitive": 1.8, "open_ended": 0.95}  # minimum speedup at batch 1

PASSAGES = [
    (
        "lighthouse",
        "tower",
        "The old lighthouse stood at the edge of the cliff, watching over the harbor. Every night the keeper climbed "
        "the narrow stairs, lit the great lamp, and wrote the weather in his logbook. Ships passing the harbor trusted "
        "the lighthouse to guide them home through fog and storm. In the morning he put out the lamp, cleaned the "
        "glass, and walked down to the village to buy bread and fresh fish for his supper.",
    ),
    (
        "Monday",
        "Friday",
        "On Monday the team met in the small room on the third floor to plan the release. Anna read the list of open "
        "bugs, Peter wrote the tasks on the whiteboard, and everyone agreed to finish the tests before Monday evening. "
        "After the meeting they ordered pizza, fixed two of the bugs, and sent a short report to the manager, who "
        "replied that the plan looked good and that the release could go out next week.",
    ),
    (
        "river",
        "canal",
        "The river runs through the middle of the town, under five stone bridges and past the old mill. In summer "
        "children swim in the river near the park, and in winter the water turns grey and cold. Fishermen sit on the "
        "banks every morning with their long rods, and boats carry apples and wood from the farms to the market square "
        "where the river bends toward the sea.",
    ),
    (
        "bread",
        "cake",
        "To bake the bread, mix the flour, the salt and the yeast in a large bowl, then add warm water and stir until "
        "the dough comes together. Knead the dough on a floured table for ten minutes, put it back in the bowl, cover "
        "it with a towel and let it rise for one hour. Shape the dough into a loaf, bake it for forty minutes, and let "
        "the bread cool before you cut it.",
    ),
]

CODE = [
    (
        "Rename the method `add_inventory_item` to `add_item` in this code and reply with the whole code.",
        "python",
        """class InventoryManager:
    def __init__(self):
        self.inventory_items = {}

    def add_inventory_item(self, item_name, item_quantity):
        self.inventory_items[item_name] = self.inventory_items.get(item_name, 0) + item_quantity

    def remove_inventory_item(self, item_name, item_quantity):
        self.inventory_items[item_name] = self.inventory_items.get(item_name, 0) - item_quantity

    def get_inventory_item(self, item_name):
        return self.inventory_items.get(item_name, 0)
""",
    ),
    (
        "Rename the variable `temperature_readings` to `readings` in this code and reply with the whole code.",
        "python",
        """def compute_average_temperature(temperature_readings):
    total_temperature = 0
    for temperature_reading in temperature_readings:
        total_temperature += temperature_reading
    return total_temperature / len(temperature_readings)


def compute_maximum_temperature(temperature_readings):
    maximum_temperature = temperature_readings[0]
    for temperature_reading in temperature_readings:
        if temperature_reading > maximum_temperature:
            maximum_temperature = temperature_reading
    return maximum_temperature
""",
    ),
    (
        "Add a comment above each function in this code and reply with the whole code.",
        "javascript",
        """function getUserName(user) {
    return user.firstName + " " + user.lastName;
}

function getUserEmail(user) {
    return user.emailAddress.toLowerCase();
}

function getUserAge(user) {
    return new Date().getFullYear() - user.birthYear;
}

function getUserCity(user) {
    return user.address.city;
}
""",
    ),
    (
        "Rename the class `CustomerRecord` to `Customer` in this code and reply with the whole code.",
        "python",
        """class CustomerRecord:
    def __init__(self, customer_id, customer_name, customer_email):
        self.customer_id = customer_id
        self.customer_name = customer_name
        self.customer_email = customer_email

    def to_dict(self):
        return {"customer_id": self.customer_id, "customer_name": self.customer_name,
                "customer_email": self.customer_email}


def load_customer_records(rows):
    return [CustomerRecord(row[0], row[1], row[2]) for row in rows]
""",
    ),
]

OPEN_ENDED = [
    "Write a short story about a dragon who learns to cook.",
    "Describe your ideal weekend in the mountains.",
    "Write a letter to a friend you have not seen in ten years.",
    "Explain why people enjoy music, in a few paragraphs.",
    "Write a poem about the first day of autumn.",
    "Invent a new sport and describe how it is played.",
    "Tell the story of a robot that wants to become a gardener.",
    "What would a city on the Moon look like? Describe a day there.",
]


def workloads() -> dict[str, list[str]]:
    repetitive = [
        f'Repeat the following passage, changing only "{old}" to "{new}":\n\n{text}' for old, new, text in PASSAGES
    ]
    # the fence's language matters: with a bare ``` the model tends to write new code instead of copying
    repetitive += [f"{task}\n\n```{language}\n{code}```" for task, language, code in CODE]
    return {"repetitive": repetitive, "open_ended": list(OPEN_ENDED)}


def spec_config(args: argparse.Namespace) -> dict:
    if args.method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.num_speculative_tokens}


def spec_counters(llm: LLM, num_spec: int) -> dict:
    """The speculative-decoding counters of ``stats()``; accepted drafts by position as one list, whether
    the engine gives a list (``..._per_pos``) or one key per position (``..._per_pos_<i>``)."""
    stats = llm.llm_engine.stats()
    found = {
        key: stats[key]
        for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    }
    per_pos = "spec_decode_num_accepted_tokens_per_pos"
    found[per_pos] = (
        list(stats[per_pos]) if per_pos in stats else [stats.get(f"{per_pos}_{i}", 0) for i in range(num_spec)]
    )
    return found


def combine(a: dict, b: dict, sign: int) -> dict:
    """``a + sign * b`` of two counter dicts (lists element-wise)."""
    return {
        key: [x + sign * y for x, y in zip(a[key], b[key])] if isinstance(a[key], list) else a[key] + sign * b[key]
        for key in a
    }


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for one ``generate`` call of ``prompts``, and each reply's token ids."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


Runner = Callable[[list[list[int]], int], tuple[float, list[list[int]]]]


def hf_peer(model_dir, eos_token_ids: list[int], threads: int) -> dict[str, Runner]:
    """transformers' greedy ``generate`` on the model folder, plain and with prompt lookup: runners like
    ``run`` (one prompt per call: transformers' prompt lookup takes batch 1)."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # generation-flag notes, the weight-loading bar
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.set_num_threads(threads)

    def generate(extra: dict, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        seconds, replies = 0.0, []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=eos_token_ids,
                    pad_token_id=eos_token_ids[0],
                    **extra,
                )
            seconds += time.perf_counter() - start
            replies.append(out[0, len(prompt) :].tolist())  # the EOS included, as in raypaged's replies
        return seconds, replies

    return {"hf_plain": functools.partial(generate, {}), "hf_lookup": functools.partial(generate, PEER_LOOKUP)}


def measure(
    engines: dict[str, Runner], prompts: list[list[int]], batch: int, max_tokens: int, flip: int
) -> dict[str, tuple[float, list[list[int]]]]:
    """Every engine on ``prompts``, ``batch`` per ``generate`` call; the engines alternate call by call
    (which order alternates too), so a slow spell of the machine falls on all."""
    seconds = dict.fromkeys(engines, 0.0)
    replies: dict[str, list[list[int]]] = {label: [] for label in engines}
    for group, i in enumerate(range(0, len(prompts), batch)):
        labels = list(engines) if (group + flip) % 2 == 0 else list(engines)[::-1]
        for label in labels:
            elapsed, out = engines[label](prompts[i : i + batch], max_tokens)
            seconds[label] += elapsed
            replies[label] += out
    return {label: (seconds[label], replies[label]) for label in engines}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(cell: dict, num_spec: int) -> dict:
    base_tps = cell["tokens"] / sum(cell["base_s"])
    spec_tps = cell["spec_tokens"] / sum(cell["spec_s"])
    c = cell["counters"]
    drafts, draft_tokens, accepted = (
        c["spec_decode_num_drafts"],
        c["spec_decode_num_draft_tokens"],
        c["spec_decode_num_accepted_tokens"],
    )
    per_pos = c["spec_decode_num_accepted_tokens_per_pos"]
    return {
        "tokens_generated": cell["tokens"],
        "base_tokens_per_s": base_tps,
        "spec_tokens_per_s": spec_tps,
        "speedup": spec_tps / base_tps,
        "round_speedups": [b / s for b, s in zip(cell["base_s"], cell["spec_s"])],  # equal tokens
        "base_s": cell["base_s"],
        "spec_s": cell["spec_s"],
        "verifications": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_accepted_per_verification": accepted / drafts if drafts else 0.0,
        "mean_draft_tokens_per_verification": draft_tokens / drafts if drafts else 0.0,
        "acceptance_per_position": [n / drafts if drafts else 0.0 for n in per_pos[:num_spec]],
        "accepted_per_position_counts": per_pos,
        "outputs_equal": not cell["mismatches"],
        "mismatches": cell["mismatches"],
    }


def summarize_peer(cell: dict) -> dict:
    """The batch-1 peer figures over the rounds the peer ran, raypaged's over the same rounds."""
    rounds = len(cell["peer_s"]["hf_plain"])
    tps = {label: cell["peer_tokens"][label] / sum(cell["peer_s"][label]) for label in PEERS}
    base_tps = cell["peer_rp_tokens"]["base"] / sum(cell["base_s"][:rounds])
    spec_tps = cell["peer_rp_tokens"]["spec"] / sum(cell["spec_s"][:rounds])
    equal = {label: {"equal": cell["peer_equal"][label], "of": cell["peer_compared"]} for label in PEERS}
    return {
        "rounds": rounds,
        "hf_plain_tokens_per_s": tps["hf_plain"],
        "hf_lookup_tokens_per_s": tps["hf_lookup"],
        "hf_lookup_speedup": tps["hf_lookup"] / tps["hf_plain"],
        "raypaged_base_tokens_per_s": base_tps,
        "raypaged_spec_tokens_per_s": spec_tps,
        "raypaged_spec_over_hf_lookup": spec_tps / tps["hf_lookup"],
        "raypaged_base_over_hf_plain": base_tps / tps["hf_plain"],
        "tokens_generated": cell["peer_tokens"],
        "hf_plain_s": cell["peer_s"]["hf_plain"],
        "hf_lookup_s": cell["peer_s"]["hf_lookup"],
        # replies (round, prompt) token-for-token equal to raypaged's greedy ones (without speculation)
        "replies_equal_raypaged": equal,
        "mismatches": cell["peer_mismatches"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (128; 32 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (3; 1 with --quick)")
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-model", default=None, help="the draft model's folder (--method draft_model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument(
        "--no-peer", action="store_true", help="skip the transformers peer (plain generate and prompt lookup, batch 1)"
    )
    parser.add_argument(
        "--peer-rounds",
        type=int,
        default=None,
        help="measured rounds with the peer (the first ones: 2, at most --rounds)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a second core is often busy here, and two threads then stall)",
    )
    args = parser.parse_args()
    if args.method == "draft_model" and not args.draft_model:
        parser.error("--method draft_model needs --draft-model PATH")
    torch.set_num_threads(args.threads)
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    num_rounds = args.rounds or (1 if args.quick else 3)
    peer_rounds = 0 if args.no_peer else min(num_rounds, 2 if args.peer_rounds is None else args.peer_rounds)
    speculative = spec_config(args)
    num_spec = args.num_speculative_tokens
    name = "spec_bench" if args.method == "ngram" else "spec_bench_draft_model"
    log = Log()
    report: dict = {
        "machine": machine_info(args.threads),
        "load_average_start": load_average(),
        "note": CONTENTION_NOTE,
        "model": default_model_dir().name,
        "quick": args.quick,
        "max_tokens": max_tokens,
        "rounds": num_rounds,
        "speculative_config": speculative,
        "peer_rounds": peer_rounds,
    }
    log(
        f"{report['model']} fp32, torch threads {args.threads}, max_tokens {max_tokens}, {num_rounds} rounds, "
        f"speculative_config {speculative}; load {report['load_average_start']}"
    )
    wall_start = time.perf_counter()
    base = LLM(kv_cache_space=1, max_model_len=MAX_MODEL_LEN)
    spec = LLM(kv_cache_space=1, max_model_len=MAX_MODEL_LEN, speculative_config=speculative)
    engine = base.llm_engine
    prompts = {
        name_: [
            render_chat(engine.tokenizer, [{"role": "user", "content": text}], engine.config, trusted=True)
            for text in texts
        ]
        for name_, texts in workloads().items()
    }
    keys = [(w, b) for w in prompts for b in BATCHES]
    engines: dict[str, Runner] = {"base": functools.partial(run, base), "spec": functools.partial(run, spec)}
    peers: dict[str, Runner] = {}
    if peer_rounds:
        import transformers

        eos_ids = list(engine.eos_token_ids)
        peers = hf_peer(default_model_dir(), eos_ids, args.threads)
        report["peer"] = {
            "transformers": transformers.__version__,
            "generate": {**PEER_LOOKUP, "do_sample": False},
            "eos_token_id": eos_ids,
            "batch": 1,
        }
        log(
            f"peer: transformers {transformers.__version__} generate, plain and {PEER_LOOKUP}, batch 1, "
            f"eos {eos_ids}, in the first {peer_rounds} round(s)"
        )
    for w, b in keys:  # warm-up: every shape once, and the prompts into both prefix caches
        measure({**engines, **peers} if b == 1 else engines, prompts[w], b, 8, 0)
    cells = {
        key: {
            "tokens": 0,
            "spec_tokens": 0,
            "base_s": [],
            "spec_s": [],
            "mismatches": [],
            "counters": None,
            "replies": None,
            "peer_s": {label: [] for label in PEERS},
            "peer_tokens": dict.fromkeys(PEERS, 0),
            "peer_rp_tokens": {"base": 0, "spec": 0},
            "peer_equal": dict.fromkeys(PEERS, 0),
            "peer_compared": 0,
            "peer_mismatches": [],
        }
        for key in keys
    }
    for round_index in range(num_rounds):
        for w, b in keys:
            cell = cells[(w, b)]
            with_peer = b == 1 and round_index < peer_rounds
            before = spec_counters(spec, num_spec)
            timed = measure({**engines, **peers} if with_peer else engines, prompts[w], b, max_tokens, round_index)
            delta = combine(spec_counters(spec, num_spec), before, -1)
            cell["counters"] = delta if cell["counters"] is None else combine(cell["counters"], delta, 1)
            (base_s, base_out), (spec_s, spec_out) = timed["base"], timed["spec"]
            cell["base_s"].append(base_s)
            cell["spec_s"].append(spec_s)
            cell["tokens"] += sum(len(r) for r in base_out)
            cell["spec_tokens"] += sum(len(r) for r in spec_out)
            for i, (x, y) in enumerate(zip(base_out, spec_out)):
                if x != y:
                    cell["mismatches"].append(
                        {
                            "round": round_index,
                            "prompt": i,
                            "base_tokens": len(x),
                            "spec_tokens": len(y),
                            "first_difference": first_difference(x, y),
                        }
                    )
            cell["replies"] = base_out
            tokens = sum(len(r) for r in base_out)
            spec_tokens = sum(len(r) for r in spec_out)
            log(
                f"round {round_index + 1} {w:10s} batch {b}: base {tokens / base_s:6.1f} tokens/s, spec "
                f"{spec_tokens / spec_s:6.1f} tokens/s ({base_s / spec_s:.2f}x); replies equal: "
                f"{sum(x == y for x, y in zip(base_out, spec_out))}/{len(base_out)}"
            )
            if not with_peer:
                continue
            cell["peer_rp_tokens"]["base"] += tokens
            cell["peer_rp_tokens"]["spec"] += spec_tokens
            cell["peer_compared"] += len(base_out)
            line = []
            for label in PEERS:
                peer_s, peer_out = timed[label]
                peer_tokens = sum(len(r) for r in peer_out)
                cell["peer_s"][label].append(peer_s)
                cell["peer_tokens"][label] += peer_tokens
                equal = 0
                for i, (x, y) in enumerate(zip(base_out, peer_out)):
                    equal += x == y
                    if x != y:
                        cell["peer_mismatches"].append(
                            {
                                "peer": label,
                                "round": round_index,
                                "prompt": i,
                                "raypaged_tokens": len(x),
                                "peer_tokens": len(y),
                                "first_difference": first_difference(x, y),
                            }
                        )
                cell["peer_equal"][label] += equal
                line.append(f"{label} {peer_tokens / peer_s:6.1f} tokens/s (equal to raypaged {equal}/{len(base_out)})")
            log(f"        {w:10s} batch 1 peer: " + ", ".join(line))
    base.shutdown()
    spec.shutdown()
    tokenizer = engine.tokenizer
    results: dict = {}
    for (w, b), cell in cells.items():
        results.setdefault(w, {})[f"batch_{b}"] = summarize(cell, num_spec)
        if b == 1 and peer_rounds:
            results[w]["batch_1"]["peer"] = summarize_peer(cell)
    # the batch-8 replies (greedy): to check the replies copy what they should
    samples = {
        w: [
            {"prompt_tokens": len(p), "reply_tokens": len(r), "reply": tokenizer.decode(r)}
            for p, r in zip(prompts[w], cells[(w, 8)]["replies"])
        ]
        for w in prompts
    }
    goals = {}
    for w, minimum in GOALS.items():
        got = results[w]["batch_1"]["speedup"]
        goals[f"{w}_batch_1"] = {"goal": minimum, "speedup": got, "met": got >= minimum}
    log("")
    header = (
        f"{'workload':10s} {'batch':>5s} {'base tok/s':>10s} {'spec tok/s':>10s} {'ratio':>6s} {'accept':>6s} "
        f"{'acc/verif':>9s} {'per position':>{6 * num_spec}s}  equal"
    )
    log(header)
    log("-" * len(header))
    for w in results:
        for b in BATCHES:
            r = results[w][f"batch_{b}"]
            per_pos = " ".join(f"{x:5.2f}" for x in r["acceptance_per_position"])
            log(
                f"{w:10s} {b:5d} {r['base_tokens_per_s']:10.1f} {r['spec_tokens_per_s']:10.1f} {r['speedup']:5.2f}x "
                f"{r['acceptance_rate']:6.2f} {r['mean_accepted_per_verification']:9.2f} {per_pos:>{6 * num_spec}s}  "
                f"{r['outputs_equal']}"
            )
    log("")
    for key, goal in goals.items():
        log(f"goal {key}: >= {goal['goal']}x, got {goal['speedup']:.2f}x: {'met' if goal['met'] else 'NOT met'}")
    all_equal = all(r["outputs_equal"] for per_batch in results.values() for r in per_batch.values())
    log(f"replies token-for-token equal with and without speculation (greedy): {all_equal}")
    if peer_rounds:
        log("")
        log(f"transformers peer, batch 1 ({peer_rounds} round(s); raypaged over the same rounds, calls alternated):")
        header = (
            f"{'workload':10s} {'hf tok/s':>9s} {'hf-lookup':>9s} {'ratio':>6s} {'rp tok/s':>9s} "
            f"{'rp-ngram':>9s} {'ratio':>6s} {'rp-ngram/hf-lookup':>18s} {'rp/hf':>6s} "
            f"{'equal plain':>11s} {'equal lookup':>12s}"
        )
        log(header)
        log("-" * len(header))
        for w in results:
            p = results[w]["batch_1"]["peer"]
            eq = p["replies_equal_raypaged"]
            log(
                f"{w:10s} {p['hf_plain_tokens_per_s']:9.1f} {p['hf_lookup_tokens_per_s']:9.1f} "
                f"{p['hf_lookup_speedup']:5.2f}x {p['raypaged_base_tokens_per_s']:9.1f} "
                f"{p['raypaged_spec_tokens_per_s']:9.1f} "
                f"{p['raypaged_spec_tokens_per_s'] / p['raypaged_base_tokens_per_s']:5.2f}x "
                f"{p['raypaged_spec_over_hf_lookup']:17.2f}x {p['raypaged_base_over_hf_plain']:5.2f}x "
                f"{'{equal}/{of}'.format(**eq['hf_plain']):>11s} {'{equal}/{of}'.format(**eq['hf_lookup']):>12s}"
            )
        log("(equal: peer replies token-for-token equal to raypaged's greedy replies, over rounds x prompts)")
    rounds_spread = {
        f"{w}_batch_{b}": [round(x, 2) for x in results[w][f"batch_{b}"]["round_speedups"]]
        for w in results
        for b in BATCHES
    }
    log(f"per-round speedups: {rounds_spread}")
    report.update(
        results=results,
        goals=goals,
        outputs_equal=all_equal,
        replies_batch_8=samples,
        wall_s=time.perf_counter() - wall_start,
        load_average_end=load_average(),
        median_round_speedups={k: statistics.median(v) for k, v in rounds_spread.items()},
    )
    log(f"wall {report['wall_s']:.0f} s; load at the end {report['load_average_end']}")
    path = write_json(name, report)
    (RESULTS_DIR / f"{name}.log").write_text("\n".join(log.lines) + "\n")
    print(f"wrote {path} and {path.with_suffix('.log')}")


if __name__ == "__main__":
    main()
