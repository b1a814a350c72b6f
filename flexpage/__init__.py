"""flexpage: PagedAttention as FlexAttention programs, and an LLM engine and server on top.

``import flexpage`` registers ``attn_implementation="flexpage"`` with HF transformers.
"""

from flexpage.model.hf_backend import register as _register_hf_backend

_register_hf_backend()

__version__ = "0.1.0"

from flexpage.llm import LLM  # noqa: E402
from flexpage.outputs import CompletionOutput, RequestOutput  # noqa: E402
from flexpage.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
