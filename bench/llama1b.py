"""A randomly initialised Llama-3.2-1B-shaped model, exported for every engine as its users would.

    python -m bench.llama1b --out DIR --llama-cpp SRC [--convert-python PATH] [--openvino-python PATH]

Issue 58's second size: at 1B a decode step reads ~0.7 GB of Q4_0 weights, so batch-1 decode
is memory-bound and the engines' ratios differ from 135M's. Writes, under ``--out``:

* ``hf/`` -- the model (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocabulary
  128,256, tied embeddings, RoPE theta 500,000 without Llama 3's long-context scaling; weights
  N(0, 0.02) from a fixed seed, stored bf16) with SmolLM2's tokenizer grown to the vocabulary
  by added tokens (``<|extra_i|>``), so every token id has a piece;
* ``bf16.gguf``, ``q8_0.gguf`` and ``q4_0.gguf`` -- llama.cpp's own converter
  (``convert_hf_to_gguf.py`` under ``--llama-cpp``, the llama.cpp source tree) to bf16 and
  Q8_0 (run by ``--convert-python``: it imports ``sentencepiece``, which flexpage does not
  need; vLLM's environment has it), and its quantiser (``build/bin/llama-quantize``, default settings) from bf16 to Q4_0;
  flexpage and llama.cpp both load these files;
* ``ov-fp16/`` and ``ov-int4/`` -- ``optimum-cli export openvino --weight-format fp16 | int4``
  in the OpenVINO environment (``--openvino-python``: that environment's python).

Each step is skipped when its output exists. Then, for example::

    python -m bench.anchors --gguf DIR/q4_0.gguf --openvino-model DIR/ov-int4 \\
        --openvino-python /work/ov-venv/bin/python --llama-server .../llama-server \\
        --out bench/results/anchors_1b_q4_0.json --plot docs/img/anchors_1b_q4_0.png
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
             max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def make_hf(folder: Path, seed: int = 0) -> None:
    """The random model and its tokenizer in ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from flexpage.model.loader import resolve_model_path

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPE, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    missing = SHAPE["vocab_size"] - len(tokenizer)
    tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(missing)], special_tokens=True)
    assert len(tokenizer) == SHAPE["vocab_size"], len(tokenizer)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(command: list[str], **env: str) -> None:
    started = time.perf_counter()
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, **env})
    print(f"  {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (with build/bin)")
    p.add_argument("--convert-python", default=sys.executable, help="a python with sentencepiece, for the converter")
    p.add_argument("--openvino-python", default=None)
    args = p.parse_args()
    out, src = args.out, args.llama_cpp
    hf = out / "hf"
    if not (hf / "config.json").exists():
        make_hf(hf)
    convert = [args.convert_python, str(src / "convert_hf_to_gguf.py"), str(hf)]
    gguf_py = {"PYTHONPATH": str(src / "gguf-py")}
    for outtype in ("bf16", "q8_0"):
        if not (out / f"{outtype}.gguf").exists():
            run([*convert, "--outtype", outtype, "--outfile", str(out / f"{outtype}.gguf")], **gguf_py)
    if not (out / "q4_0.gguf").exists():
        run([str(src / "build" / "bin" / "llama-quantize"), str(out / "bf16.gguf"), str(out / "q4_0.gguf"), "Q4_0"])
    if args.openvino_python:
        cli = Path(args.openvino_python).parent / "optimum-cli"
        for fmt in ("fp16", "int4"):
            if not (out / f"ov-{fmt}" / "openvino_model.xml").exists():
                run([str(cli), "export", "openvino", "--model", str(hf), "--task", "text-generation-with-past",
                     "--weight-format", fmt, str(out / f"ov-{fmt}")])


if __name__ == "__main__":
    main()
