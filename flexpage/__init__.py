"""flexpage: PagedAttention as FlexAttention programs, and an LLM engine and server on top.

``import flexpage`` registers ``attn_implementation="flexpage"`` with HF transformers.
"""

from flexpage.attention.hf_backend import register as _register_hf_backend

_register_hf_backend()

__version__ = "0.1.0"
