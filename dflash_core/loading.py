"""Load a target (any transformers causal LM) and a z-lab-format DFlash draft; check that they pair."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_core.chat import eos_token_ids
from dflash_core.compile import (
    StaticShapes,
    compile_enabled,
    default_batch_sizes,
    parse_sizes,
    probe_cpu_compiler,
    use_compile_cache,
)
from dflash_core.config import DraftConfig, EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.draft_formats import read_draft_config
from dflash_core.engine import Engine
from dflash_core.grammar import LLGuidanceBackend
from dflash_core.memory import (
    ACTIVATION_RESERVE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    MemoryBudget,
    PoolCosts,
    available_memory,
    cuda_cache_budget,
    kv_bytes_per_row,
    no_pool,
    normalize_shape,
    parse_bytes,
    plan_memory,
    pool_state_costs,
    ram_cache_budget,
    verify_logits_bytes,
)
from dflash_core.runners.base import TargetRunner
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES, HybridTarget, hybrid_unsupported
from dflash_core.runners.native import NativeTarget, supports

log = logging.getLogger("dflash.loading")

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "draft"
# The largest default batch bucket of the compiled step: each bucket is a CUDA graph per width and key length, so
# --max-num-seqs 256 must not mean compiling (and holding the memory of) 256-row graphs; a step of more running
# requests runs eagerly, where the per-launch overhead that graphs remove is small next to a batch that wide.
MAX_STATIC_BATCH = 64

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
    memory: MemoryBudget | None = None  # the start-up memory plan (logged)


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


def set_threads(threads: int | None, device: Any) -> None:
    """torch's CPU threads: `threads`, else 1 on a CPU device (a small model's forwards are launch-bound, and
    on a shared or small CPU one thread measured fastest for both DFlash and plain decoding); CUDA keeps torch's."""
    if threads is None and str(device).startswith("cpu"):
        threads = 1
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def load_models(config: EngineConfig, warm_up: bool = True) -> LoadedModels:
    """Load target + draft + tokenizer into an Engine, as `config` says. No target means the bundled demo pair.

    backend "hf" runs the transformers model one request per forward; "native" runs our batched forward over a
    paged KV pool (target and draft pages, one block-id space) sized by the memory plan; "auto" picks native where
    supported.
    `warm_up`: the runners' compile warm-up runs here, on the calling thread; recorded CUDA graphs are per thread,
    so a caller whose steps run on another thread passes False and runs `Engine.warm_up` there.
    """
    from transformers import AutoTokenizer

    target, draft = config.target, config.draft
    if target is None:
        target, draft = DEMO_TARGET, draft or DEMO_DRAFT
        if not Path(target).exists():
            raise FileNotFoundError(f"the bundled demo pair is missing at {DEMO_DIR}")
    block_size = config.block_size
    dev = resolve_device(config.device)
    set_threads(config.threads, dev)
    if compile_enabled(config.compile, dev):
        use_compile_cache(config.compile_cache)  # before the first compile, and the CPU checks below, use it
        probe_cpu_compiler(dev)
    dt = resolve_dtype(config.dtype, dev)
    tok = AutoTokenizer.from_pretrained(str(local_folder(config.tokenizer or target)))
    model = load_target(target, dev, dt)
    use_draft = config.speculative and draft is not None and (block_size is None or block_size > 1)
    draft_path = local_folder(draft) if use_draft else None
    cfg = read_draft_config(draft_path) if draft_path is not None else None
    layer_ids = cfg.target_layer_ids if cfg is not None else None
    block = (block_size or cfg.block_size) if cfg is not None else 1
    budget = memory_budget(config, model, cfg, dev, dt, block)
    for note in budget.notes:
        log.info("memory plan: %s", note)
    log.info("%s", budget.summary())
    slots = budget.slots  # the running cap, lowered for a hybrid whose recurrent states would not fit
    static = static_shapes(config, dev, slots)
    target_model = make_target(model, layer_ids, config.backend, slots, budget.max_model_len, block, static,
                               num_blocks=budget.num_blocks, kv_block=config.kv_block_size)
    drafter = None
    if cfg is not None:
        check_pair(cfg, target_model)
        draft_model = DFlashDraft.from_folder(draft_path, device=dev, dtype=dt)
        # a slot-indexed target gets a slot-indexed (batched) draft cache of the same slots and length
        batched = target_model.max_slots is not None
        slot_cache = dict(max_slots=target_model.max_slots, max_len=target_model.max_len) if batched else {}
        draft_static = static_shapes(config, dev) if isinstance(target_model, NativeTarget) else None
        drafter = DFlashDrafter(draft_model, target_model, block, window=config.draft_window, static=draft_static,
                                **slot_cache)
    if warm_up:  # compiled static shapes, here; a server runs `Engine.warm_up` on its worker thread instead
        target_model.warm_up()
        if drafter is not None:
            drafter.warm_up()
    engine = Engine(target_model, drafter, eos_token_ids=eos_token_ids(model, tok), max_model_len=budget.max_model_len,
                    max_slots=slots, grammar=LLGuidanceBackend(tok, target_model.vocab_size),
                    speculation=config.speculation, max_num_batched_tokens=config.max_num_batched_tokens,
                    prefill_chunk=config.prefill_chunk or None, enable_prefix_caching=config.enable_prefix_caching)
    return LoadedModels(
        engine=engine,
        tokenizer=tok,
        target_name=str(target),
        draft_name=str(draft) if use_draft else None,
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
        block_size=engine.block_size,
        backend=target_model.backend,
        memory=budget,
    )


def static_shapes(config: EngineConfig, device: torch.device, slots: int | None = None) -> StaticShapes | None:
    """The buckets of the compiled decode step, or None when compile is off (--no-compile; on CPU by default).
    Default batch buckets: powers of two up to the running cap, at most MAX_STATIC_BATCH (see there)."""
    if not compile_enabled(config.compile, device):
        return None
    use_compile_cache(config.compile_cache)
    batch = parse_sizes(config.compile_batch_sizes, "compile_batch_sizes")
    widths = parse_sizes(config.compile_widths, "compile_widths")
    assert widths is not None
    cap = min(slots or config.max_running_requests, MAX_STATIC_BATCH)
    return StaticShapes(batch or default_batch_sizes(cap), widths, scope=config.compile_scope)


def pool_costs(
    model: Any, draft_cfg: DraftConfig | None, dtype: torch.dtype, block: int, kv_block: int,
    prefix_caching: bool = True,
) -> PoolCosts:
    """Bytes per position of the loaded pair's KV pool, as the runners allocate it (target attention layers' K and
    V, the draft's layers' K and V in the same block ids), a hybrid's recurrent state per running request (with
    `prefix_caching`, its checkpoint copies and the checkpoint store too), and the block + 1 positions a request may
    reach beyond max_model_len (the runners' max_len)."""
    nbytes = torch.tensor([], dtype=dtype).element_size()
    shape = normalize_shape(model.config.to_dict())
    draft_row = 0
    if draft_cfg is not None:
        draft_row = 2 * draft_cfg.num_hidden_layers * draft_cfg.num_key_value_heads * int(draft_cfg.head_dim) * nbytes
    return PoolCosts(kv_bytes_per_row(shape, nbytes), draft_row, kv_block=kv_block, extra_len=block + 1,
                     **pool_state_costs(shape, nbytes, prefix_caching, verify_tokens=block))


def paged(model: Any, backend: str) -> bool:
    """Whether the target runs on a paged runner (native), which has a KV pool to plan; hf has none."""
    return backend != "hf" and native_runner(model)[0] is not None


def memory_budget(
    config: EngineConfig, model: Any, draft_cfg: DraftConfig | None, device: torch.device, dtype: torch.dtype,
    block: int,
) -> MemoryBudget:
    """The start-up memory plan: the KV pool from --kv-cache-memory, else on CUDA --gpu-memory-utilization (0.9
    by default) less the weights, an activation reserve and the widest step's logits, else a share of the free RAM
    (`ram_cache_budget`); ValueError when one request of max_model_len cannot fit (it says what would). Runs after
    the target's weights load and before the caches and the draft's weights are allocated (the draft is counted
    from its shape)."""
    nbytes = torch.tensor([], dtype=dtype).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    draft_weights = 0
    if draft_cfg is not None:
        with torch.device("meta"):
            draft_weights = sum(p.numel() for p in DFlashDraft(draft_cfg).parameters()) * nbytes
    weights += draft_weights
    slots = config.max_running_requests
    model_max = int(getattr(model.config, "max_position_embeddings", 4096))
    if not paged(model, config.backend):
        if config.kv_cache_memory is not None or config.gpu_memory_utilization is not None:
            log.warning("the hf backend has no KV pool: --kv-cache-memory / --gpu-memory-utilization are not applied")
        return no_pool(weights, slots, config.max_model_len or model_max, config.kv_block_size)
    costs = pool_costs(model, draft_cfg, dtype, block, config.kv_block_size, config.enable_prefix_caching)
    if config.kv_cache_memory is not None:
        cache_budget, source = parse_bytes(config.kv_cache_memory), f"--kv-cache-memory {config.kv_cache_memory}"
    elif device.type == "cuda":
        utilization = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        free, total = torch.cuda.mem_get_info(device)
        logits = verify_logits_bytes(slots, block, int(model.config.vocab_size), config.max_num_batched_tokens)
        cache_budget = cuda_cache_budget(utilization, total, weights, logits)
        source = f"--gpu-memory-utilization {utilization} of {total / 1e9:.1f} GB"
        # never more than the card has free now (another process, or another engine of this one, holds the rest):
        # the target's weights are loaded already, the draft's are still to come
        room = free - draft_weights - ACTIVATION_RESERVE - logits
        if room < cache_budget:
            cache_budget, source = room, f"{source}, capped by the {free / 1e9:.1f} GB free"
        if cache_budget <= 0:
            raise ValueError(f"{source} leaves nothing for the KV pool after {weights / 1e9:.2f} GB of weights, the "
                             f"activation reserve and {logits / 1e9:.2f} GB of logits; raise it")
    elif config.gpu_memory_utilization is not None:
        raise ValueError(f"--gpu-memory-utilization sizes the caches of a CUDA card; on {device.type} use "
                         f"--kv-cache-memory")
    else:
        cache_budget = ram_cache_budget(available_memory(), pending=draft_weights)
        source = f"the {device.type} default (a quarter of the available RAM, at most 1 GiB; set --kv-cache-memory)"
    return plan_memory(costs, weights, slots, config.max_model_len, model_max, cache_budget, source)


def native_runner(model: Any) -> tuple[type[NativeTarget] | None, str | None]:
    """The native runner class for `model`, or None and the reason none runs it."""
    if model.config.model_type in HYBRID_MODEL_TYPES:
        reason = hybrid_unsupported(model)
        return (HybridTarget, None) if reason is None else (None, reason)
    reason = supports(model)
    return (NativeTarget, None) if reason is None else (None, reason)


def make_target(
    model: Any, layer_ids: list[int] | None, backend: str, max_slots: int, max_model_len: int | None, block: int,
    static: StaticShapes | None = None, num_blocks: int | None = None, kv_block: int = 16,
) -> TargetRunner:
    """The target runner for `backend` (hf, native or auto: native where it runs the model). A native runner's KV
    pool has `num_blocks` blocks of `kv_block` positions (None: every slot at full length, the runners' default)."""
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
    if runner is HybridTarget:
        if static is not None:  # its recurrent layers record per-row state for rollback, in Python
            log.info("compile: the hybrid runner's steps run eagerly")
        return runner(model, layer_ids, max_slots=max_slots, max_len=max_len, num_blocks=num_blocks, kv_block=kv_block)
    return runner(model, layer_ids, max_slots=max_slots, max_len=max_len, static=static, num_blocks=num_blocks,
                  kv_block=kv_block)
