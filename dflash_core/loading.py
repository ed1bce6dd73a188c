"""Load a target (any transformers causal LM) and a z-lab-format DFlash draft; check that they pair."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_core.chat import eos_token_ids
from dflash_core.config import DraftConfig, EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.draft_formats import read_draft_config
from dflash_core.engine import Engine
from dflash_core.runners.base import TargetRunner
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES, HybridTarget, hybrid_unsupported
from dflash_core.runners.native import NativeTarget, supports

log = logging.getLogger("dflash.loading")

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "draft"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModels:
    """Everything the server or a benchmark needs, loaded once."""

    engine: Engine
    tokenizer: Any
    target_name: str
    draft_name: str | None
    device: str
    dtype: str
    block_size: int
    backend: str = "hf"


def resolve_device(device: str = "auto") -> torch.device:
    """CUDA when present, else CPU; an explicit name is taken as is."""
    if device in ("auto", "", None):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 on CPU, unless named."""
    if dtype in ("auto", "", None):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def local_folder(name_or_path: str | Path) -> Path:
    """A local folder, or a hub id fetched into the local cache (only on machines that have a hub)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path)))
    except Exception as exc:  # offline, missing, private: one clear message
        raise FileNotFoundError(f"{name_or_path!r} is neither a local folder nor a reachable hub id: {exc}") from exc


def check_pair(cfg: DraftConfig, target: TargetRunner) -> None:
    """Fail with a message naming the field when the draft does not fit the target."""
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(f"draft/target mismatch in hidden_size: draft {cfg.hidden_size}, target {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"draft/target mismatch in vocab_size: draft {cfg.vocab_size}, target {target.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(
            f"draft/target mismatch in target_layer_ids: {bad} not in the target's {target.num_layers} layers"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(
            f"draft/target mismatch in mask_token_id: {cfg.mask_token_id} outside the vocabulary ({target.vocab_size})"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        log.warning("draft was trained for %d target layers, target has %d", cfg.num_target_layers, target.num_layers)


def load_target(path: str | Path, device: torch.device, dtype: torch.dtype) -> Any:
    """A transformers causal LM in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(local_folder(path)), dtype=dtype)
    return model.to(device).eval()


def load_models(config: EngineConfig) -> LoadedModels:
    """Load target + draft + tokenizer into an Engine, as `config` says. No target means the bundled demo pair.

    backend "hf" runs the transformers model one request per forward; "native" runs our batched forward over a
    slot KV cache sized `max_running_requests` x (max_model_len + block); "auto" picks native where supported.
    """
    from transformers import AutoTokenizer

    target, draft = config.target, config.draft
    if target is None:
        target, draft = DEMO_TARGET, draft or DEMO_DRAFT
        if not Path(target).exists():
            raise FileNotFoundError(f"the bundled demo pair is missing at {DEMO_DIR}")
    block_size = config.block_size
    dev = resolve_device(config.device)
    dt = resolve_dtype(config.dtype, dev)
    tok = AutoTokenizer.from_pretrained(str(local_folder(config.tokenizer or target)))
    model = load_target(target, dev, dt)
    use_draft = config.speculative and draft is not None and (block_size is None or block_size > 1)
    draft_path = local_folder(draft) if use_draft else None
    cfg = read_draft_config(draft_path) if draft_path is not None else None
    layer_ids = cfg.target_layer_ids if cfg is not None else None
    block = (block_size or cfg.block_size) if cfg is not None else 1
    slots = config.max_running_requests
    target_model = make_target(model, layer_ids, config.backend, slots, config.max_model_len, block)
    drafter = None
    if cfg is not None:
        check_pair(cfg, target_model)
        draft_model = DFlashDraft.from_folder(draft_path, device=dev, dtype=dt)
        # a slot-indexed target gets a slot-indexed (batched) draft cache of the same slots and length
        batched = target_model.max_slots is not None
        slot_cache = dict(max_slots=target_model.max_slots, max_len=target_model.max_len) if batched else {}
        drafter = DFlashDrafter(draft_model, target_model, block, window=config.draft_window, **slot_cache)
    max_len = config.max_model_len or target_model.max_position_embeddings
    engine = Engine(target_model, drafter, eos_token_ids=eos_token_ids(model, tok), max_model_len=max_len,
                    max_slots=slots)
    return LoadedModels(
        engine=engine,
        tokenizer=tok,
        target_name=str(target),
        draft_name=str(draft) if use_draft else None,
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
        block_size=engine.block_size,
        backend=target_model.backend,
    )


def native_runner(model: Any) -> tuple[type[NativeTarget] | None, str | None]:
    """The native runner class for `model`, or None and the reason none runs it."""
    if model.config.model_type in HYBRID_MODEL_TYPES:
        reason = hybrid_unsupported(model)
        return (HybridTarget, None) if reason is None else (None, reason)
    reason = supports(model)
    return (NativeTarget, None) if reason is None else (None, reason)


def make_target(
    model: Any, layer_ids: list[int] | None, backend: str, max_slots: int, max_model_len: int | None, block: int
) -> TargetRunner:
    """The target runner for `backend` (hf, native or auto: native where it runs the model)."""
    if backend not in ("hf", "native", "auto"):
        raise ValueError(f"unknown backend {backend!r}; choose hf, native or auto")
    runner, reason = native_runner(model)
    if model.config.model_type in HYBRID_MODEL_TYPES and (backend == "hf" or runner is None):
        # transformers' cache for these layers cannot be cropped, so a rejected draft could not be rolled back
        raise ValueError(f"model_type {model.config.model_type!r} (Gated DeltaNet layers) runs on the native backend "
                         f"only: {'use backend native or auto' if runner else reason}")
    if backend == "hf" or (backend == "auto" and runner is None):
        if backend == "auto":
            log.info("backend auto: the hf backend runs this target (native does not support %s)", reason)
        return HFTarget(model, layer_ids)
    if runner is None:
        raise ValueError(f"the native backend does not support {reason}; use backend hf")
    max_len = (max_model_len or int(getattr(model.config, "max_position_embeddings", 4096))) + block + 1
    return runner(model, layer_ids, max_slots=max_slots, max_len=max_len)
