"""Speculative decoding (prompt lookup) vs none, on text worth copying and on text with nothing to copy.

    python -m bench.speculative [--rounds 3] [--max-tokens 160] [--quick] [--crossover] [--step-costs]
                                [--k 10] [--ngram 3 5] [--max-branches 3] [--dtype float32] [--deterministic]
                                [--openvino-python /work/ov-venv/bin/python --openvino-model DIR]

On the default model (SmolLM2-135M-Instruct, bf16 where the CPU has it, or ``--dtype``), one
process, two engines built alike except for ``speculative_config`` (``ngram``, ``--k`` 10,
n-grams of ``--ngram`` 3-5 tokens; the engine's other defaults, ``disable_by_batch_size``
included). Why k = 10 (HF's prompt-lookup default): when a copy is under way it runs long, and
on AMX CPUs a verification step of 5-16 rows costs about what 4 rows do (the projections run
the GGUF blocks on the AMX tiles), 1.4x a decode step.

* ``grounded``: 16 chat requests whose answers copy from the prompt -- repeat a paragraph,
  edit a code snippet and give it back whole, answer with quotes from a given document --
  greedy, up to ``--max-tokens`` tokens, stopping at EOS;
* ``random``: 16 prompts of random tokens (bench.anchors' workload: log-normal lengths,
  here capped at 512), 64 greedy tokens each, EOS ignored.

Each workload runs at batch 1 (requests one after another) and batch 16 (all at once);
rounds alternate which engine goes first. Reported per workload and batch: output tok/s of
each engine (median over rounds) and their ratio, the acceptance rate and mean accepted
length per verification, and whether every output was token-identical between the engines
(greedy: it must be). ``--crossover`` adds the grounded workload at batches 1, 2, 4, 8 and 16
with ``disable_by_batch_size`` lifted (the speculating engine proposes at every batch size),
which is where the default comes from. ``--step-costs`` adds what one sequence's verification
step of k + 1 rows costs (k = 0: a decode step), over a cached prompt of a sentence repeated
``--step-cost-repeats`` times (12: ~250 tokens).

``--max-branches N`` lets prompt lookup propose up to N continuations verified as one tree and
adds a third engine, the same with one branch: every workload and batch runs the tree
engine against it too (``versus_one_branch``: whether the extra branches pay).

``--openvino-python`` / ``--openvino-model`` add OpenVINO GenAI's prompt lookup
(``LLMPipeline(model, "CPU", prompt_lookup=True)``, greedy, the same k and n-gram size) on the
same prompt tokens at batch 1, run by ``bench/openvino_lookup.py`` in that interpreter (its
own venv: see ../shared/MEASUREMENTS.md), between the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.anchors import VOCAB_RANGE

DEFAULT_OUT = Path("bench/results/speculative.json")
DRAFT_OUT = Path("bench/results/speculative_draft.json")
BRANCHES_OUT = Path("bench/results/speculative_branches.json")
K, LOOKUP_MIN, LOOKUP_MAX = 10, 3, 5

PARAGRAPHS = [
    "The lighthouse on the northern cape was built in 1874 from granite quarried two miles inland. For most of "
    "its working life it was tended by a single keeper, who climbed the one hundred and twelve steps four times "
    "a night to wind the clockwork that turned the lens. The light was automated in 1962, and the keeper's "
    "cottage is now a small museum that opens on summer weekends.",
    "To repot a houseplant, water it a day before so the roots hold together. Choose a pot one size larger with "
    "a drainage hole, add a layer of fresh soil, and ease the plant out by tipping the old pot on its side. "
    "Loosen any roots that circle the bottom, set the plant at the same depth as before, fill around it with "
    "soil, and water until it drains.",
    "Our quarterly report shows revenue of 4.2 million dollars, up eight percent from the same quarter last "
    "year. Costs rose more slowly than sales, mainly because shipping prices fell in the second month. The "
    "board approved two new hires for the support team and postponed the office move until the spring.",
    "Honeybees communicate the location of food through a movement called the waggle dance. A forager that "
    "has found flowers walks in a figure eight on the comb, and the angle of the straight part of the dance "
    "tells the other bees the direction of the food relative to the sun, while its length tells them the "
    "distance.",
    "The train to the coast leaves platform four at seven fifteen every morning except Sunday. Passengers "
    "with bicycles should board the last carriage, which has space for six bikes. Tickets bought on the train "
    "cost more than tickets bought at the station, and season tickets are sold only at the main office.",
    "When the meeting started, Maria explained that the new scheduling system would replace the shared "
    "spreadsheet by the end of the month. Each team will enter its own shifts, the system will flag any "
    "overlaps, and managers will approve changes from their phones instead of sending emails.",
]

CODE = [
    ("def total_price(items):\n    result = 0\n    for item in items:\n        result = result + item.price * "
     "item.quantity\n    return result\n\n\ndef average_price(items):\n    if not items:\n        return 0\n    "
     "return total_price(items) / len(items)\n", "Rename the variable result to total"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        "
     "self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n    def is_empty(self):"
     "\n        return len(self.items) == 0\n", "Add a method size that returns the number of items"),
    ("import json\n\n\ndef load_config(path):\n    with open(path) as handle:\n        config = json.load(handle)"
     "\n    if 'name' not in config:\n        config['name'] = 'default'\n    return config\n",
     "Change the default name from 'default' to 'unnamed'"),
    ("def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
     "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
     "        else:\n            print(i)\n", "Rename the function fizzbuzz to play"),
    ("def read_lines(path):\n    lines = []\n    with open(path) as f:\n        for line in f:\n            "
     "lines.append(line.strip())\n    return lines\n", "Skip empty lines"),
]

DOCUMENT = (
    "Section 1. Members may borrow up to ten books at a time. Section 2. Books are lent for three weeks and may "
    "be renewed twice, online or at the desk. Section 3. A book that is returned late costs twenty cents per "
    "day. Section 4. Lost books are charged at their replacement price plus a fee of five dollars. Section 5. "
    "The reading room is open from nine in the morning until eight in the evening on weekdays."
)
QUESTIONS = ["How many books can a member borrow?", "How long are books lent for?",
             "What does a late book cost?", "What happens if a book is lost?",
             "When is the reading room open?"]


def grounded_chats() -> list[list[dict[str, str]]]:
    """Sixteen chats whose answers copy from their prompts."""
    chats = [[{"role": "user", "content": f"Repeat the following paragraph exactly, word for word:\n\n{p}"}]
             for p in PARAGRAPHS]
    chats += [[{"role": "user", "content": f"{task}. Reply with the complete code only.\n\n```python\n{code}```"}]
              for code, task in CODE]
    chats += [[{"role": "user", "content": f"Document:\n{DOCUMENT}\n\nQuestion: {q}\nAnswer by quoting the "
                                           f"sentence of the document that answers it."}] for q in QUESTIONS]
    return chats


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 0.8, count), 16, 512).astype(int)
    return [rng.integers(*VOCAB_RANGE, n).tolist() for n in lengths]


def run(llm: Any, prompts: list[list[int]], params: Any, batch: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate every prompt, ``batch`` at a time, and the outputs."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        done = llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + batch]], params)
        outputs += [list(o.outputs[0].token_ids) for o in done]
    return time.perf_counter() - start, outputs


def spec_counts(llm: Any) -> tuple[int, int, int]:
    stats = llm.engine.stats()
    return (stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"],
            stats["spec_decode_num_drafts"])


def measure(plain: Any, spec: Any, prompts: list[list[int]], params: Any, batch: int, rounds: int) -> dict:
    """Both engines on ``prompts`` at ``batch``, alternating which goes first."""
    rates: dict[str, list[float]] = {"plain": [], "speculative": []}
    identical = True
    before = spec_counts(spec)
    for r in range(rounds):
        order = [("plain", plain), ("speculative", spec)]
        outputs = {}
        for name, llm in order if r % 2 == 0 else order[::-1]:
            seconds, outputs[name] = run(llm, prompts, params, batch)
            rates[name].append(sum(len(o) for o in outputs[name]) / seconds)
        identical &= outputs["plain"] == outputs["speculative"]
    drafted, accepted, verifications = (a - b for a, b in zip(spec_counts(spec), before))
    plain_tok_s, spec_tok_s = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
    return {
        "batch": batch, "prompts": len(prompts), "output_tokens": sum(len(o) for o in outputs["plain"]),
        "plain_tok_s": plain_tok_s, "speculative_tok_s": spec_tok_s, "ratio": spec_tok_s / plain_tok_s,
        "per_round_ratio": [round(s / p, 3) for p, s in zip(rates["plain"], rates["speculative"])],
        "per_round_plain_tok_s": [round(x, 1) for x in rates["plain"]],
        "per_round_speculative_tok_s": [round(x, 1) for x in rates["speculative"]],
        "draft_tokens": drafted, "accepted_tokens": accepted, "verifications": verifications,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_per_verification": accepted / verifications if verifications else 0.0,
        "token_identical": identical, "outputs": outputs["plain"],
    }


def step_costs(llm: Any, rounds: int = 3, repeats: int = 12) -> dict[str, float]:
    """Milliseconds per step of one sequence verifying k prompt-lookup proposals that are always
    accepted (a numbered sentence repeated ``repeats`` times, 128 greedy tokens, the prompt cached), for
    k = 0 (a plain decode step) to 15: the cost of a verification step of k + 1 rows. Median
    over ``rounds``."""
    from flexpage import SamplingParams

    speculator = llm.engine.speculator
    default = speculator.config
    text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen. " * repeats
    prompt = llm.engine.tokenizer(text).input_ids
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    costs: dict[int, list[float]] = {}
    for _ in range(rounds):
        for k in (0, 1, 3, 4, 7, 11, 15):
            speculator.config = speculator.proposer.config = dataclasses.replace(default, num_speculative_tokens=max(k, 1))
            accepted = speculator.num_accepted_tokens
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
                temperature=0, max_tokens=128, ignore_eos=True, num_speculative_tokens=k))[0]
            seconds = time.perf_counter() - start
            steps = len(out.outputs[0].token_ids) - (speculator.num_accepted_tokens - accepted)
            costs.setdefault(k, []).append(seconds / steps * 1e3)
    speculator.config = speculator.proposer.config = default
    return {f"k{k}": statistics.median(v) for k, v in costs.items()}


def openvino(python: str, model: str, prompts: list[list[int]], lengths: list[int], rounds: int, k: int,
             max_ngram: int) -> dict:
    """OpenVINO GenAI's prompt lookup (``k`` tokens, n-grams up to ``max_ngram``) and plain
    greedy decoding at batch 1, in ``python``: prompt ``i`` generates ``lengths[i]`` tokens
    (flexpage's output length: OpenVINO ignores EOS)."""
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "requests.json"
        out = Path(tmp) / "out.json"
        requests.write_text(json.dumps([{"prompt_token_ids": p, "max_new_tokens": n} for p, n in zip(prompts, lengths)]))
        script = Path(__file__).with_name("openvino_lookup.py")
        subprocess.run([python, str(script), "--model", model, "--requests", str(requests), "--out", str(out),
                        "--k", str(k), "--max-ngram", str(max_ngram), "--rounds", str(rounds)], check=True)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--crossover", action="store_true", help="grounded workload at batches 1-16, nothing disabled")
    p.add_argument("--step-cost-repeats", type=int, default=12,
                   help="the step-cost prompt's length: a 17-token sentence this many times")
    p.add_argument("--step-costs", action="store_true",
                   help="ms per verification step of k + 1 rows, k = 0-15 (prompt lookup only)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 4 prompts each, 32 tokens")
    p.add_argument("--dtype", default="auto", help="both engines' dtype (float32: greedy tokens must be identical)")
    p.add_argument("--deterministic", action="store_true", help="both engines deterministic (bf16 identity)")
    p.add_argument("--openvino-python", default=None)
    p.add_argument("--openvino-model", default=None)
    p.add_argument("--draft-layers", type=int, default=None,
                   help="propose with a draft model: the default model's first N layers and its LM head")
    p.add_argument("--k", type=int, default=K, help="num_speculative_tokens (both proposers, and OpenVINO's)")
    p.add_argument("--ngram", type=int, nargs=2, default=(LOOKUP_MIN, LOOKUP_MAX), metavar=("MIN", "MAX"),
                   help="prompt_lookup_min and prompt_lookup_max (OpenVINO's max_ngram_size: MAX)")
    p.add_argument("--max-branches", type=int, default=1,
                   help="prompt lookup's max_branches; above 1 a one-branch engine runs beside, for the ratio")
    p.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT} ({DRAFT_OUT} with a draft)")
    args = p.parse_args()

    from flexpage import LLM, SamplingParams

    started = time.perf_counter()
    config = {"dtype": args.dtype, "deterministic": args.deterministic}
    speculative = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.ngram[0],
                   "prompt_lookup_max": args.ngram[1], "max_branches": args.max_branches}
    if args.draft_layers is not None:
        from flexpage.speculative.draft_model import save_layer_draft

        draft_dir = tempfile.TemporaryDirectory(prefix="flexpage-draft-")  # removed when the run ends
        folder = save_layer_draft(None, args.draft_layers, draft_dir.name)
        speculative = {"method": "draft_model", "model": folder, "num_speculative_tokens": args.k}
    out = args.out or (DRAFT_OUT if args.draft_layers is not None else BRANCHES_OUT if args.max_branches > 1
                       else DEFAULT_OUT)
    plain, spec = LLM(**config), LLM(speculative_config=speculative, **config)
    one_branch = LLM(speculative_config={**speculative, "max_branches": 1}, **config) \
        if args.max_branches > 1 and args.draft_layers is None else None
    for llm in (plain, spec, one_branch):
        if llm is not None:
            llm.engine.warm_up()
    tokenizer = plain.engine.tokenizer
    grounded = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
                for c in grounded_chats()]
    noise = random_prompts(16, seed=7)
    rounds, max_tokens, random_tokens = args.rounds, args.max_tokens, 64
    if args.quick:
        grounded, noise, rounds, max_tokens, random_tokens = grounded[::4], noise[:4], 1, 32, 16
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (default)", "dtype": str(plain.engine.dtype),
                              "deterministic": args.deterministic,
                              "draft_layers": args.draft_layers,
                              "speculative_config": {**speculative, "disable_by_batch_size":
                                                     spec.engine.speculator.config.disable_by_batch_size},
                              "rounds": rounds, "ready_s": time.perf_counter() - started, "runs": {}}
    print(f"ready in {result['ready_s']:.0f} s", flush=True)
    workloads = {
        "grounded": (grounded, SamplingParams(temperature=0.0, max_tokens=max_tokens)),
        "random": (noise, SamplingParams(temperature=0.0, max_tokens=random_tokens, ignore_eos=True)),
    }
    plan = [(name, batch) for name in workloads for batch in (1, len(workloads[name][0]))]
    for name, batch in plan:
        prompts, params = workloads[name]
        row = measure(plain, spec, prompts, params, batch, rounds)
        result["runs"][f"{name}_b{batch}"] = row
        print(f"{name} batch {batch}: plain {row['plain_tok_s']:.1f} tok/s, speculative {row['speculative_tok_s']:.1f} "
              f"tok/s, ratio {row['ratio']:.2f} {row['per_round_ratio']}; acceptance {row['acceptance_rate']:.2f}, "
              f"{row['mean_accepted_per_verification']:.2f} accepted per verification; identical "
              f"{row['token_identical']}", flush=True)
        if one_branch is not None:
            versus = measure(one_branch, spec, prompts, params, batch, rounds)
            result.setdefault("versus_one_branch", {})[f"{name}_b{batch}"] = {
                k: v for k, v in versus.items() if k != "outputs"}
            print(f"  {args.max_branches} branches vs 1: {versus['ratio']:.2f} {versus['per_round_ratio']}; tree "
                  f"verifications {spec.engine.stats()['spec_decode_num_tree_drafts']}", flush=True)
    if args.step_costs and args.draft_layers is None:
        result["step_cost_prompt_repeats"] = args.step_cost_repeats
        result["step_ms"] = step_costs(spec, repeats=args.step_cost_repeats)
        print("ms per step, k proposals always accepted: " + ", ".join(f"{k} {v:.1f}" for k, v in result["step_ms"].items()))
    if args.crossover:
        speculator = spec.engine.speculator
        default = speculator.config
        speculator.config = dataclasses.replace(default, disable_by_batch_size=1 << 20)
        prompts, params = workloads["grounded"]
        result["crossover"] = {}
        for batch in (1, 2, 4, 8, 16):
            row = measure(plain, spec, prompts, params, batch, rounds)
            result["crossover"][f"b{batch}"] = {k: v for k, v in row.items() if k != "outputs"}
            print(f"crossover, grounded batch {batch}: ratio {row['ratio']:.2f} {row['per_round_ratio']}", flush=True)
        speculator.config = default
    if args.openvino_python and args.openvino_model:
        flex = result["runs"]["grounded_b1"]
        ov = openvino(args.openvino_python, args.openvino_model, workloads["grounded"][0],
                      [max(1, len(o)) for o in flex["outputs"]], rounds, args.k, args.ngram[1])
        result["openvino_genai"] = {k: v for k, v in ov.items() if k != "per_request"}
        # where OpenVINO's greedy tokens first differ from flexpage's (None: nowhere; its EOS is
        # masked, so a flexpage output that ends with EOS differs at its last token at least)
        result["openvino_genai"]["first_difference_from_flexpage"] = [
            next((i for i, (a, b) in enumerate(zip(r["plain"]["tokens"], o)) if a != b), None)
            for r, o in zip(ov["per_request"][: len(flex["outputs"])], flex["outputs"])]
        lookup = ov["modes"]["prompt_lookup"]["tok_s_median"]
        result["speculative_over_openvino_lookup_b1"] = flex["speculative_tok_s"] / lookup
        print(f"OpenVINO GenAI batch 1 grounded: prompt lookup {lookup:.1f} tok/s, plain "
              f"{ov['modes']['plain']['tok_s_median']:.1f}; flexpage speculative / OpenVINO lookup "
              f"{result['speculative_over_openvino_lookup_b1']:.2f}x", flush=True)
    runs = result["runs"]
    result["token_identical_everywhere"] = all(r["token_identical"] for r in runs.values())
    # identity is a target where the engines' kernels do not depend on the rows a step runs:
    # float32, or deterministic bf16 (plain bf16 differs between batch sizes without speculation too)
    identity_is_a_target = args.deterministic or str(plain.engine.dtype) == "torch.float32"
    result["targets"] = {
        **({"token_identical_everywhere": result["token_identical_everywhere"]} if identity_is_a_target else {}),
        "grounded_b1_ge_2.0x": runs["grounded_b1"]["ratio"] >= 2.0,
        "random_b1_ge_0.95x": runs["random_b1"]["ratio"] >= 0.95,
        "b16_ge_1.0x": all(r["ratio"] >= 1.0 for k, r in runs.items() if not k.endswith("_b1")),
    }
    if "speculative_over_openvino_lookup_b1" in result:
        result["targets"]["grounded_b1_ge_openvino_lookup"] = result["speculative_over_openvino_lookup_b1"] >= 1.0
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in result["targets"].items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
