"""The bottom layer: what every other part of selfspec runs on (docs/ARCHITECTURE.md).

``models`` (the one model loader), ``tiny`` (test models), ``layers`` (decoder-layer stack), ``cache`` (KV cache
layers and rollback), ``kernels`` / ``skinny`` (CPU linear backends), ``attention``, ``io`` (atomic writes, file
names, cache home), ``identity`` (which base model a draft module belongs to), ``adapters`` (LoRA backbones),
``prompts``, ``gguf_wheels``. Importing it checks the transformers version (``compat``).
"""

from selfspec.runtime.compat import check_transformers

check_transformers()
