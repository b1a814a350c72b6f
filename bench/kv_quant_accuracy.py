"""Which 8-bit KV scales keep SmolLM2's likelihood: a fake-quantisation study before any kernel.

    python -m bench.kv_quant_accuracy [--tokens 4096] [--greedy] [--out PATH]

HF transformers' SmolLM2-135M-Instruct (the default model, float32) scores a fixed text, teacher
forced: the mean negative log-likelihood of every token after the first. Attention goes
through a wrapper of HF's SDPA that rounds the keys (after RoPE, as flexpage's pool stores
them) and values to int8 with a given scale layout and widens them back, so the only change
is the 8-bit cache's rounding. Layouts:

* ``bf16``: keys and values rounded to bfloat16 (the engine's cache today; the reference);
* ``per_token``: one scale per token and head (max |x| over the head's channels);
* ``per_channel_static``: one scale per layer, head and channel, calibrated once on another
  text (max |x| over its tokens; the same channel pair for RoPE's halves) and clamped: the
  layout that folds the key scale into the query and the value scale into the output;
* ``per_channel_oracle``: the same, calibrated on the scored text itself (what static
  calibration could reach at best);
* ``kivi``: keys per channel (static, as above), values per token (KIVI, Liu et al. 2024);
* ``keys_per_token``: keys per token, values per channel (static): the layout whose key scale a
  ``score_mod`` can apply (score x the key's scale) and whose value scale folds into the output;
* ``u8_groups_of_32``: OpenVINO's default x86 cache: unsigned 8-bit codes with a scale and a
  zero point per token, head and group of 32 channels;
* ``per_channel_static_12bit``: ``per_channel_static`` with 2,047 steps a side instead of 127.

``--greedy`` adds a second measure, stricter than likelihood: the first 64 greedy tokens of
``bench.kv_dtype``'s 50 chat prompts under each layout, identical to float32's or not (and
the mean position of the first difference, 64 where identical or where both stop alike).

Texts: Python's own documentation strings (``pydoc_data.topics``, fixed for a Python
version): the scored text from the middle, the calibration text from the start. Writes
--out (bench/results/kv_quant_accuracy.json).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

DEFAULT_OUT = Path("bench/results/kv_quant_accuracy.json")
Quantise = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def texts(tokenizer, tokens: int) -> tuple[list[int], list[int]]:
    """(scored, calibration) token ids from disjoint parts of Python's topic documentation."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics))).input_ids
    middle = len(ids) // 2
    return ids[middle:middle + tokens], ids[:tokens]


def round_int8(x: torch.Tensor, scale: torch.Tensor, qmax: int = 127) -> torch.Tensor:
    return (x / scale).round().clamp(-qmax, qmax) * scale


def u8_groups(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Round ``x [B, H, T, D]`` to 256 levels between the min and max of each token's groups of
    ``group`` channels (a scale and a zero point per group)."""
    grouped = x.unflatten(-1, (x.shape[-1] // group, group))
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = ((high - low) / 255).clamp_min(1e-8)
    return (((grouped - low) / step).round() * step + low).flatten(-2)


def per_token(x: torch.Tensor) -> torch.Tensor:
    """Round ``x [B, H, T, D]`` with one scale per token and head."""
    return round_int8(x, x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127)


def channel_scales(x: torch.Tensor, rope_pairs: bool) -> torch.Tensor:
    """Per head and channel scales ``[H, 1, D]`` of ``x [1, H, T, D]`` (max over tokens); with
    ``rope_pairs`` channel ``i`` and ``i + D/2`` share one (RoPE rotates them together)."""
    peak = x.abs().amax(dim=(0, 2))
    if rope_pairs:
        half = peak.shape[-1] // 2
        pair = torch.maximum(peak[:, :half], peak[:, half:])
        peak = torch.cat([pair, pair], dim=-1)
    return (peak.clamp_min(1e-8) / 127)[:, None, :]


class Recorder:
    """Attention that records each layer's keys and values (for calibration) unchanged."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer], self.values[layer] = k, v
        return k, v


def layouts(calibration: Recorder, scored: Recorder) -> dict[str, Quantise]:
    def static(recorder: Recorder, values_per_token: bool, qmax: int = 127) -> Quantise:
        k_scales = {i: channel_scales(k, True) * 127 / qmax for i, k in recorder.keys.items()}
        v_scales = {i: channel_scales(v, False) * 127 / qmax for i, v in recorder.values.items()}

        def quantise(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            v_out = per_token(v) if values_per_token else round_int8(v, v_scales[layer], qmax)
            return round_int8(k, k_scales[layer], qmax), v_out

        return quantise

    return {
        "bf16": lambda layer, k, v: (k.bfloat16().float(), v.bfloat16().float()),
        "per_token": lambda layer, k, v: (per_token(k), per_token(v)),
        "per_channel_static": static(calibration, False),
        "per_channel_oracle": static(scored, False),
        "kivi": static(calibration, True),
        "keys_per_token": keys_per_token(calibration),
        "u8_groups_of_32": lambda layer, k, v: (u8_groups(k), u8_groups(v)),
        "per_channel_static_12bit": static(calibration, False, qmax=2047),
    }


def keys_per_token(recorder: Recorder) -> Quantise:
    v_scales = {i: channel_scales(v, False) for i, v in recorder.values.items()}
    return lambda layer, k, v: (per_token(k), round_int8(v, v_scales[layer]))


def attend_through(model, quantise: Quantise) -> None:  # noqa: ANN001
    """Route ``model``'s attention through ``quantise`` (all of the cache, every call: each
    layout rounds a rounded value to itself)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = quantise(module.layer_idx, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kv_quant_study", attention)
    AttentionMaskInterface.register("kv_quant_study", sdpa_mask)
    model.set_attn_implementation("kv_quant_study")


def nll(model, ids: list[int], quantise: Quantise) -> float:
    """Mean negative log-likelihood of ``ids[1:]`` with attention through ``quantise``."""
    attend_through(model, quantise)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()


def greedy(model, prompts: list[list[int]], quantise: Quantise | None, tokens: int = 64) -> list[list[int]]:
    """The first ``tokens`` greedy tokens of each prompt, alone (no padding), attention through
    ``quantise`` (None: float32 as it is)."""
    attend_through(model, quantise or (lambda layer, k, v: (k, v)))
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False,
                               pad_token_id=model.config.eos_token_id)[0, len(p):].tolist() for p in prompts]


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """How many outputs equal the reference's, and the mean position of the first difference."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
             for x, y in zip(reference, outputs)]
    return {"identical": sum(x == y for x, y in zip(reference, outputs)), "of": len(reference),
            "mean_first_difference": sum(first) / len(first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--greedy", action="store_true", help="also greedy agreement with float32 on 50 chat prompts")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flexpage.model.loader import resolve_model_path

    path = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    scored_ids, calibration_ids = texts(tokenizer, args.tokens)
    calibration, scored = Recorder(), Recorder()
    nll(model, calibration_ids, calibration)  # records the calibration text's keys and values
    full = nll(model, scored_ids, scored)  # float32, and the scored text's own (the oracle's scales)
    rows = {"float32": full}
    for name, quantise in layouts(calibration, scored).items():
        start = time.perf_counter()
        rows[name] = nll(model, scored_ids, quantise)
        print(f"{name:20s} NLL {rows[name]:.5f}  ppl {math.exp(rows[name]):8.3f}  "
              f"{(rows[name] / rows['bf16'] - 1) * 100 if 'bf16' in rows else 0.0:+.3f}% vs bf16  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{'float32':20s} NLL {full:.5f}")
    result = {"model": str(path), "tokens": len(scored_ids), "nll": rows,
              "vs_bf16_percent": {k: (v / rows["bf16"] - 1) * 100 for k, v in rows.items()}}
    if args.greedy:
        from bench.kv_dtype import chat_prompts

        prompts = chat_prompts(tokenizer, 50)
        outputs = {"float32": greedy(model, prompts, None)}
        result["greedy_vs_float32"], result["greedy_vs_bf16"] = {}, {}
        for name, quantise in layouts(calibration, scored).items():
            if name == "per_channel_oracle":  # its scales are the scored text's, not the chats'
                continue
            start = time.perf_counter()
            outputs[name] = greedy(model, prompts, quantise)
            row = result["greedy_vs_float32"][name] = agreement(outputs["float32"], outputs[name])
            result["greedy_vs_bf16"][name] = agreement(outputs["bf16"], outputs[name])
            print(f"{name:24s} greedy identical to float32's {row['identical']}/{row['of']} (to bf16's "
                  f"{result['greedy_vs_bf16'][name]['identical']}), first difference from float32's at "
                  f"{row['mean_first_difference']:.1f} on average ({time.perf_counter() - start:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
