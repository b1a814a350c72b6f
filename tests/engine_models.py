"""Tiny random-weight Hugging Face checkpoints for the engine tests.

Each builder writes an ordinary HF folder (``save_pretrained`` safetensors + config +
generation config + tokenizer) that ``LLM(model=folder)`` and
``AutoModelForCausalLM.from_pretrained(folder)`` both load. The tokenizer files are
copied from the converted SmolLM2 folder, so every tiny config uses its vocabulary
(49152 ids; bos 1, eos 2).

The models are small (2 layers, hidden 64) so that a forward pass costs milliseconds,
but each one exercises what makes its architecture different:

* ``mistral``: ``sliding_window`` shorter than the test prompts;
* ``gemma2``: alternating sliding/global layers, ``attn_logit_softcapping`` and
  ``final_logit_softcapping``, with query/key weights scaled up so the attention
  logits are large enough for the soft cap to change them;
* ``qwen2``: biased q/k/v projections; ``qwen3``: per-head q/k RMS norms;
* ``llama``: the plain baseline (GQA), used where only the engine's bookkeeping matters;
* ``bloom``: ALiBi instead of rotary positions.

Random weights give repetitive text; the tests only compare tokens with HF.
Weights are scaled up from HF's default init (std 0.02) so that logits are spread
out and greedy argmax never hinges on float rounding.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Any, Callable

import torch

VOCAB_SIZE = 49152
BOS_ID, EOS_ID = 1, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

#: Sliding window of the tiny Mistral/Gemma2 models; the test prompts are longer.
SLIDING_WINDOW = 12
#: Gemma2's attention soft cap; q/k weights are scaled so scores reach well beyond it.
ATTN_SOFTCAP = 4.0
QK_SCALE = 6.0

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=EOS_ID,
    initializer_range=0.08,
    tie_word_embeddings=False,
)


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON)


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, sliding_window=SLIDING_WINDOW)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(
        **{**_COMMON, "tie_word_embeddings": True},
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=ATTN_SOFTCAP,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    )


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**{k: v for k, v in _COMMON.items() if k != "head_dim"})


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON)


def _bloom() -> Any:
    from transformers import BloomConfig

    return BloomConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, n_layer=2, n_head=4, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, initializer_range=0.08,
    )


def random_prompts(lengths: tuple[int, ...] | list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids >= 3: no bos/eos/unk inside a prompt)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "bloom": _bloom,
}


def tiny_config(kind: str, **overrides: Any) -> Any:
    """The HF config of one tiny architecture, with ``overrides`` set on it."""
    if kind not in CONFIGS:
        raise ValueError(f"kind: got {kind!r}, expected one of {sorted(CONFIGS)}")
    config = CONFIGS[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _scale_qk(model: torch.nn.Module, factor: float) -> None:
    """Multiply every query/key projection weight by ``factor`` (attention logits grow by factor**2)."""
    for name, param in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            param.mul_(factor)


def build_tiny_model(kind: str, folder: pathlib.Path, tokenizer_dir: pathlib.Path, *, seed: int = 0,
                     eos_token_id: int = EOS_ID, **overrides: Any) -> pathlib.Path:
    """Write a random-weight ``kind`` checkpoint (float32) plus tokenizer into ``folder``.

    The weights depend only on ``kind``, ``seed`` and ``overrides``; ``eos_token_id`` goes
    into the generation config (what the engine and HF ``generate`` stop on).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        if kind == "gemma2":
            _scale_qk(model, QK_SCALE)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=eos_token_id, pad_token_id=EOS_ID)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        source = pathlib.Path(tokenizer_dir) / name
        if source.is_file():
            shutil.copy(source, folder / name)
    return folder


def load_reference(folder: pathlib.Path, **config_overrides: Any) -> Any:
    """The same checkpoint in plain HF transformers (fp32, sdpa/eager attention) for reference outputs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32, local_files_only=True)
    return model.eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int, *, stop_at_eos: bool = True,
              **generate_kwargs: Any) -> list[int]:
    """Tokens HF appends greedily to one unpadded prompt.

    ``stop_at_eos``: HF ``generate(do_sample=False)``, which ends at EOS. Otherwise a plain
    argmax loop over the model's logits (no cache) that runs on through EOS, like
    ``ignore_eos=True``. ``generate_kwargs`` go to ``generate`` (e.g. ``eos_token_id``,
    ``min_new_tokens``).
    """
    ids = torch.tensor([prompt_ids])
    if stop_at_eos:
        kwargs = dict(eos_token_id=EOS_ID, pad_token_id=EOS_ID, temperature=None, top_p=None, top_k=None)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, **{**kwargs, **generate_kwargs})
        return out[0, len(prompt_ids):].tolist()
    for _ in range(max_new_tokens):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


@torch.no_grad()
def hf_constrained_greedy(model: Any, tokenizer: Any, prompt_ids: list[int], schema: dict, max_new_tokens: int
                          ) -> list[int]:
    """Tokens HF's argmax appends to one prompt under a JSON schema: a second implementation of
    flexpage's structured outputs (llguidance's matcher driven directly, its mask applied with
    ``masked_fill``), ending at EOS, where the grammar stops or at ``max_new_tokens``."""
    import json

    import llguidance
    import llguidance.hf

    from flexpage.structured.llguidance_backend import JSON_DEFAULTS

    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=model.config.vocab_size, eos_token=[EOS_ID])
    matcher = llguidance.LLMatcher(lltokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults=JSON_DEFAULTS))
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[: logits.shape[0]] > 0
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
        ids.append(token)
        if token == EOS_ID or matcher.is_stopped():
            break
    return out


@torch.no_grad()
def hf_logprobs(model: Any, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of HF's logits at every position that predicted an output token: ``[len(output), V]``."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(ids).logits[0].float()
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)].log_softmax(-1)


def greedy_in_two_processes(make_llm: Callable[[], Any], prompts: list[list[int]], params: Any,
                            program_dir: pathlib.Path, monkeypatch: Any) -> tuple[list, list]:
    """Run ``prompts`` through two engines from ``make_llm()``, the second as a new process
    would (the compiled step programs forgotten in memory, saved under ``program_dir``): each
    engine's greedy tokens, and the saved program files after each."""
    from flexpage.backends.cpu import saved_programs
    from flexpage.model import compiled_step

    monkeypatch.setattr(saved_programs, "program_dir", lambda: program_dir)
    tokens, saved = [], []
    try:
        for _ in range(2):
            compiled_step._program.cache_clear()  # forget the programs, as a new process has
            outputs = make_llm().generate([{"prompt_token_ids": p} for p in prompts], params)
            tokens.append([o.outputs[0].token_ids for o in outputs])
            saved.append(sorted(program_dir.glob("*.bin")))
    finally:
        compiled_step._program.cache_clear()  # later tests must not save into program_dir
    return tokens, saved


def hf_beams(model: Any, prompt_ids: list[int], beam_width: int, max_new_tokens: int, *,
             length_penalty: float = 1.0, early_stopping: bool | str = False) -> list[tuple[list[int], float]]:
    """HF ``generate``'s beam search, every beam best first: ``(output ids up to and including
    its EOS, sequences_score)``."""
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, num_beams=beam_width,
                             num_return_sequences=beam_width, max_new_tokens=max_new_tokens,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             output_scores=True, return_dict_in_generate=True)
    beams = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        tokens = row[len(prompt_ids):]
        ends = [i for i, t in enumerate(tokens) if t in eos_ids]
        beams.append((tokens[: ends[0] + 1] if ends else tokens, score))
    return beams


def round_kv_as_int8(model: Any, scales: torch.Tensor) -> Any:
    """``model`` (HF) with every layer's keys (after RoPE) and values rounded as flexpage's int8 KV
    cache stores them, ``scales [layers, 2, kv_heads, head_dim]`` (the engine's pool scales), and
    its queries on the int8 grid the cache's kernels multiply (``kv_quant.scale_queries``), before
    HF's own SDPA attention: a second implementation of the 8-bit cache's arithmetic (quantise,
    widen, attend), written without the kernels' scale folding."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x [B, H_kv, T, D], scale [H_kv, D]
        s = scale[None, :, None, :].to(x.dtype)
        return (x / s).round().clamp(-127, 127) * s

    def on_grid(query: torch.Tensor, key_scale: torch.Tensor) -> torch.Tensor:  # [B, H, T, D]: the query the
        # cache's kernels see, (query * key scale) rounded per row to 127 steps of its largest element, unscaled
        per_head = key_scale.repeat_interleave(query.shape[1] // key_scale.shape[0], 0)[None, :, None, :]
        scaled = query * per_head
        step = (scaled.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(query.dtype).tiny)
        return (scaled / step).round() * step / per_head

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                  **kwargs: Any) -> Any:
        layer = scales[module.layer_idx]
        return sdpa_attention_forward(module, on_grid(query, layer[0]), rounded(key, layer[0]), rounded(value, layer[1]),
                                      *args, **kwargs)

    AttentionInterface.register("int8_kv_reference", attention)
    AttentionMaskInterface.register("int8_kv_reference", sdpa_mask)
    model.set_attn_implementation("int8_kv_reference")
    return model
