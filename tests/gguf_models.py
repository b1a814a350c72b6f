"""A tiny Llama GGUF with Q4_1 projections and a Q8_0 embedding, for the tests of reading blocks.

It is written the way llama.cpp's converter writes Llama checkpoints: q and k rows permuted
for its RoPE layout (transformers' GGUF loader undoes that), norms in float32, the embedding
(tied to the LM head, as SmolLM2's) in Q8_0. The tokenizer comes from the packaged SmolLM2 GGUF, so the usual test prompts apply.
2 layers, hidden 64, 4 heads of 16 (2 KV heads), MLP 128.
"""

from __future__ import annotations

import pathlib

import numpy as np

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
#: (GGUF tensor kind, output rows, input features) of each layer's projections
PROJECTIONS = (("attn_q", HEADS * HEAD_DIM, HIDDEN), ("attn_k", KV_HEADS * HEAD_DIM, HIDDEN),
               ("attn_v", KV_HEADS * HEAD_DIM, HIDDEN), ("attn_output", HIDDEN, HEADS * HEAD_DIM),
               ("ffn_gate", INTERMEDIATE, HIDDEN), ("ffn_up", INTERMEDIATE, HIDDEN), ("ffn_down", HIDDEN, INTERMEDIATE))


def random_blocks(rng: np.random.Generator, kind: str, rows: int, features: int, scale: float = 0.08) -> np.ndarray:
    """``[rows, features / 32 * bytes per block]`` uint8 GGUF blocks of weights of about ``scale``
    centred on zero: Q4_1 (fp16 ``d`` around ``scale / 8``, ``m = -8 d``, random 4-bit codes),
    Q4_0 (the same ``d``, no ``m``: GGUF centres its codes on 8), Q8_0 (fp16 ``d`` around
    ``scale / 127``, random signed bytes) or Q6_K (``features`` a multiple of 256)."""
    if kind == "Q6_K":
        return _random_q6_k(rng, rows, features, scale)
    width = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = rng.integers(0, 256, (rows, features // 32, width), dtype=np.uint8)
    levels = 127 if kind == "Q8_0" else 8
    d = (rng.uniform(0.5, 1.5, (rows, features // 32)) * scale / levels).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    if kind == "Q4_1":
        blocks[..., 2:4] = (-8 * d)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _random_q6_k(rng: np.random.Generator, rows: int, features: int, scale: float) -> np.ndarray:
    """Q6_K super-blocks of 256 weights (random codes and int8 scales, fp16 ``d`` so that the
    weights are about ``scale``)."""
    blocks = rng.integers(0, 256, (rows, features // 256, 210), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (rows, features // 256)) * scale / 32 / 64).astype(np.float16)
    blocks[..., 208:210] = d[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: pathlib.Path, tokenizer_gguf: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write the tiny model to ``path`` (a ``.gguf`` file) and return it."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    rng = np.random.default_rng(seed)
    source = GGUFReader(tokenizer_gguf).fields
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    tokens = source["tokenizer.ggml.tokens"].contents()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(source["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(source["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(source["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(source["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(source["tokenizer.ggml.eos_token_id"].contents())
    writer.add_unk_token_id(source["tokenizer.ggml.unknown_token_id"].contents())
    writer.add_pad_token_id(source["tokenizer.ggml.padding_token_id"].contents())
    writer.add_chat_template(source["tokenizer.chat_template"].contents())
    writer.add_tensor("token_embd.weight", random_blocks(rng, "Q8_0", len(tokens), HIDDEN, scale=1.0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        for kind, rows, features in PROJECTIONS:
            writer.add_tensor(f"blk.{layer}.{kind}.weight", random_blocks(rng, "Q4_1", rows, features),
                              raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
