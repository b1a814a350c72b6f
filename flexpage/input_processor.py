"""Input processing: prompts (text, token ids or a dict of either) to checked token ids.

Everything a request could get wrong about its prompt is found here, before the request
is queued, and raised as :class:`~flexpage.errors.InvalidParameter` naming the field.
"""

from __future__ import annotations

from typing import Any, Union

from flexpage.errors import InvalidParameter

PromptInput = Union[str, list[int], dict[str, Any]]

__all__ = ["InputProcessor", "PromptInput", "check_optional_name"]


class InputProcessor:
    """Tokenises and checks prompts for one model."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def prepare_prompt(self, prompt: PromptInput) -> dict[str, Any]:
        """Tokenise and check one prompt: ``{"prompt", "prompt_token_ids"}``."""
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidParameter("prompt",
                f"prompt: {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidParameter("prompt",
                                   f"prompt: dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter("prompt", "prompt: got an empty string")
            return prompt, self.tokenizer(prompt, add_special_tokens=True).input_ids
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise InvalidParameter("prompt",
                               f"prompt: got {type(prompt).__name__}, expected str, list of token ids or dict")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidParameter("prompt_token_ids",
                                   f"prompt_token_ids: got {ids!r}, expected a non-empty list of ints")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidParameter("prompt_token_ids",
                                       f"prompt_token_ids: got {t!r}, expected ints in [0, {self.vocab_size})")
        return list(ids)


def check_optional_name(name: str, value: object) -> None:
    """A request's optional label (``conversation_id``, ``cache_salt``): None or a short string."""
    if value is not None and (not isinstance(value, str) or not value or len(value) > 256):
        raise InvalidParameter(name, f"{name}: got {value!r}, expected a non-empty string of at most 256 characters")
