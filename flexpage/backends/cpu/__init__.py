"""The CPU backend: one description of this CPU, and all code that edits torch internals.

* :mod:`.description`: :class:`~.description.CPUDescription`, built once per process
  (:func:`~.description.describe`): the CPU's ISA, AMX, bf16 dot products, the default dtype
  and why, and a record of which projection and attention paths this process took (and which
  failed, and why). Every ISA decision in flexpage reads it.
* :mod:`.torch_patches` and the patches it installs (:mod:`.inductor_fix`,
  :mod:`.template_tuning` with :mod:`.template_edits`, :mod:`.packed_linear_lowering`,
  :mod:`.canonical_kernel_names`), :mod:`.vec_isa_cache`, :mod:`.saved_programs`.
* :mod:`.kernel_options`: the CPU kernel options of flexpage's compiled attention.
* :mod:`.block_kernel`: building the GGUF block kernel (``gguf_linear.cpp``), and what a
  failed build does (``FLEXPAGE_KERNEL_FALLBACK``).
* :mod:`.env_report`: the text of ``flexpage env``.

Nothing is imported here: ``import flexpage`` stays cheap, and each module is loaded when used.
"""
