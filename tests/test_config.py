"""EngineConfig checks itself: a bad field is a ValueError naming it, before any model loads."""

from __future__ import annotations

import pytest
import torch

from flexpage.config import EngineConfig, parse_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, r"block_size: got 0, expected a positive int"),
        ({"block_size": 16, "attention_block_size": 24},
         r"attention_block_size: got 24, expected a multiple of block_size=16"),
        ({"max_num_seqs": True}, r"max_num_seqs: got True"),
        ({"num_blocks": 1}, r"num_blocks: got 1, expected an int >= 2"),
        ({"kv_cache_memory": "lots"}, r"kv_cache_memory: got 'lots'"),
        ({"preemption_mode": "drop"}, r"preemption_mode: got 'drop', expected 'recompute' or 'swap'"),
    ],
)
def test_bad_fields_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("block_size", "attention_block_size", "run"),
    [(16, 128, 8), (32, 128, 4), (8, 128, 16), (256, 128, 1), (16, 16, 1)],
)
def test_blocks_per_attention_block(block_size: int, attention_block_size: int, run: int) -> None:
    """Blocks are handed out in runs of attention_block_size tokens; pages at least that big are runs of one."""
    config = EngineConfig(block_size=block_size, attention_block_size=attention_block_size)
    for dtype in (torch.float32, torch.bfloat16):
        assert config.blocks_per_attention_block(dtype) == run


def test_attention_block_size_defaults_by_dtype() -> None:
    """Unset, the key block is 256 tokens for float32 pools and 128 for bf16/fp16 (docs/attention-benchmark.md)."""
    config = EngineConfig(block_size=8)
    assert config.attention_block_size is None
    assert config.blocks_per_attention_block(torch.float32) == 32
    assert config.blocks_per_attention_block(torch.bfloat16) == 16
    assert config.blocks_per_attention_block(torch.float16) == 16


def test_sizes_parse() -> None:
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MB") == 512 << 20
    assert parse_size(4096) == 4096
