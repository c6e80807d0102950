"""Shapes and names every layer above the kernels shares (no TileLang import: ``mla.ops`` registers its ops
without loading TileLang). The kernels keep their own copy in ``tl_kernels.steps``; a CPU test checks they
agree."""

import math

KV_LORA_RANK = 512  # latent dims: keys and values (the output dim)
ROPE_DIM = 64  # rope dims: keys only
QK_DIM = KV_LORA_RANK + ROPE_DIM  # 576
DEFAULT_SM_SCALE = 1.0 / math.sqrt(QK_DIM)

# Modes of the benchmarks and tests: mode -> (KV cache format, Q precision).
MODES = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "bf16"), "a8w8": ("fp8", "fp8"), "mxfp4": ("mxfp4", "bf16")}
