"""Export a saved actor checkpoint as an HF model directory (bf16 sharded safetensors, config, generation config,
tokenizer files), offline on CPU: ``python launch/export_hf.py RUN_DIR_OR_global_step_N OUT [--dtype bfloat16]
[--max-shard-size 5GB]`` (installed: ``jaxrl-hf-export-hf``). See jaxrl_hf/trainer/hf_export.py."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_hf.trainer.hf_export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
