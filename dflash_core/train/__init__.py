"""dflash-train: train a DFlash draft for any transformers causal LM target (`python -m dflash_core.train`).

One job per module: `data` (JSONL rows -> token ids), `responses` (the target writes the responses), `target`
(what the draft takes from the target: layers, mask token, config), `batches` (blocks, loss, context features),
`checkpoint` (atomic, readable writes), `loop` (the training run), `evaluation` (held-out acceptance and speedup)
and `cli` (the command line). The recipe is described in `cli` (it is what `dflash-train --help` shows).
"""

from __future__ import annotations

from dflash_core.train.batches import block_loss, context_features, make_block_batch
from dflash_core.train.checkpoint import (
    CHECKPOINT_DIR,
    DATA_FILE,
    atomic_dir_write,
    save_checkpoint,
    save_final,
    share_modes,
)
from dflash_core.train.cli import build_parser, check_output, load_target_and_tokenizer, main, parse_args, validate_args
from dflash_core.train.data import Example, UsageError, encode_rows, read_rows
from dflash_core.train.evaluation import distinct_ngram_ratio, evaluate, load_eval_prompts
from dflash_core.train.loop import train
from dflash_core.train.responses import generate_responses
from dflash_core.train.target import (
    MASK_NAMES,
    draft_config,
    draft_rope,
    layer_ids_for,
    mlp_width,
    resolve_mask_token,
    rope_parameters,
    rope_theta,
    target_layers,
)

__all__ = [
    "CHECKPOINT_DIR", "DATA_FILE", "MASK_NAMES", "Example", "UsageError", "atomic_dir_write", "block_loss",
    "build_parser", "check_output", "context_features", "distinct_ngram_ratio", "draft_config", "draft_rope",
    "encode_rows", "evaluate", "generate_responses", "layer_ids_for", "load_eval_prompts", "load_target_and_tokenizer",
    "main", "make_block_batch", "mlp_width", "parse_args", "read_rows", "resolve_mask_token", "rope_parameters",
    "rope_theta", "save_checkpoint", "save_final", "share_modes", "target_layers", "train", "validate_args",
]
