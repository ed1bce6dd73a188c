"""Load a target (any transformers causal LM) and a z-lab-format DFlash draft; check that they pair."""

from __future__ import annotations

import json
import logging
import os
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
from dflash_core.config import BACKENDS, DraftConfig, EngineConfig
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
from dflash_core.quant import checkpoint_quant_config, gguf_refusal, quant_spec
from dflash_core.quant.loader import weights_format
from dflash_core.runners.base import TargetRunner
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.dsa import DSALayout
from dflash_core.runners.generic import ATTENTION_LAYER_TYPES, GenericTarget, KVLayout, layout_of
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES, HybridTarget, hybrid_unsupported
from dflash_core.runners.native import NativeTarget, supports
from dflash_core.weight_layout import store_input_major, stores_input_major

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
    quantization: str | None = None  # the target's quantized linear weights (`quant.loader.weights_format`)
    cpu_step: str = "torch"  # what runs the target's forwards on a CPU (`TargetRunner.cpu_step`)


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


# rotary scalings whose factor stretches the trained context (llama3's and longrope's configs give the long one)
STRETCHING_ROPE = ("linear", "dynamic", "yarn")
ALLOW_LONG_ENV = "DFLASH_ALLOW_LONG_MAX_MODEL_LEN"


def max_positions(model: Any) -> int:
    """The model's own longest context, the default --max-model-len: its text config's `max_position_embeddings` (a
    multimodal checkpoint has none at the top; 4096 when the config does not say)."""
    return int(getattr(model.config.get_text_config(), "max_position_embeddings", 4096))


def longest_allowed(model: Any) -> int:
    """The longest --max-model-len served without DFLASH_ALLOW_LONG_MAX_MODEL_LEN, as vLLM derives it: the model's
    positions, or a stretching rotary scaling's reach (YaRN: its original_max_position_embeddings x factor;
    linear, dynamic: max_position_embeddings x factor), whichever is longer."""
    text = model.config.get_text_config()
    longest = max_positions(model)
    rope = getattr(text, "rope_parameters", None) or {}
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if kind in STRETCHING_ROPE and factor:
        base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        longest = max(longest, int((base or longest) * float(factor)))
    return longest


def check_max_model_len(max_model_len: int | None, model_max: int) -> None:
    """vLLM's rule: a --max-model-len past what the model was trained for is refused (ValueError, one line),
    unless DFLASH_ALLOW_LONG_MAX_MODEL_LEN=1 says the user knows (its rotary positions past it are untrained)."""
    if max_model_len is None or max_model_len <= model_max or os.environ.get(ALLOW_LONG_ENV) == "1":
        return
    raise ValueError(f"--max-model-len {max_model_len:,} is longer than the model's {model_max:,} positions "
                     f"(max_position_embeddings, or its rotary scaling's reach): lower it, or set {ALLOW_LONG_ENV}=1 "
                     f"to serve past what the model was trained for")


def load_target(
    path: str | Path, device: torch.device, dtype: torch.dtype, quantization: str | None = None
) -> Any:
    """A transformers causal LM in eval mode on `device`; a checkpoint whose config transformers maps only to an
    image-text-to-text model (Kimi K2.5) loads as that, and serves its text decoder. A quantized checkpoint (its
    config's `quantization_config`), or `quantization` ("fp8": quantize while loading), keeps its linear weights
    quantized (`dflash_core/quant/`); a format not served is refused in one line (ValueError)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    refusal = gguf_refusal(path)
    if refusal:
        raise ValueError(refusal)
    folder = local_folder(path)
    # the quantization as the checkpoint's config.json states it (before transformers reads it: a malformed one
    # fails there with a traceback)
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    spec = quant_spec(checkpoint_quant_config(folder, raw), quantization)
    config = AutoConfig.from_pretrained(str(folder))
    auto = AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModelForImageTextToText
    if spec is None:
        model = auto.from_pretrained(str(folder), dtype=dtype)
    else:
        from dflash_core.quant.loader import load_quantized

        log.info("target weights: %s", spec.describe())
        model = load_quantized(auto, folder, config, spec, dtype)
    model = model.to(device).eval()
    if spec is not None:
        from dflash_core.quant.base import choose_kernel
        from dflash_core.quant.fp8_channel import RowWiseFp8Kernel
        from dflash_core.quant.fp8_kernels import BlockFp8Kernel
        from dflash_core.quant.int4_kernel import Int4Kernel
        from dflash_core.quant.int8_channel import Int8Kernel

        if not spec.pre_quantized and weights_format(model) is None:
            log.warning("--quantization %s: no linear layer's sides divide by its %dx%d blocks; the weights stay in "
                        "full precision", spec.method, *spec.block)
        # FP8, int8 and int4 GEMMs where the device runs them correctly
        for kernel in (BlockFp8Kernel(), RowWiseFp8Kernel(), Int8Kernel(), Int4Kernel()):
            choose_kernel(model, device, kernel)
    return model


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
    refusal = gguf_refusal(target)  # before its tokenizer is looked for
    if refusal:
        raise ValueError(refusal)
    tok = AutoTokenizer.from_pretrained(str(local_folder(config.tokenizer or target)))
    model = load_target(target, dev, dt, config.quantization)
    input_major = stores_input_major(dev, dt)
    if input_major:  # before any runner packs or views the weights
        store_input_major(model)
    use_draft = config.speculative and draft is not None and (block_size is None or block_size > 1)
    draft_path = local_folder(draft) if use_draft else None
    cfg = read_draft_config(draft_path) if draft_path is not None else None
    layer_ids = cfg.target_layer_ids if cfg is not None else None
    block = (block_size or cfg.block_size) if cfg is not None else 1
    choice = choose_backend(model, config.backend)
    budget = memory_budget(config, model, cfg, dev, dt, block, choice)
    for note in budget.notes:
        log.info("memory plan: %s", note)
    log.info("%s", budget.summary())
    slots = budget.slots  # the running cap, lowered for a hybrid whose recurrent states would not fit
    static = static_shapes(config, dev, slots)
    target_model = make_target(model, layer_ids, choice, slots, budget.max_model_len, block, static,
                               num_blocks=budget.num_blocks, kv_block=config.kv_block_size)
    drafter = None
    if cfg is not None:
        check_pair(cfg, target_model)
        draft_model = DFlashDraft.from_folder(draft_path, device=dev, dtype=dt)
        if input_major:
            store_input_major(draft_model)
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
                    speculation=config.speculation, spec_sampling=config.spec_sampling,
                    tree_budget=config.tree_budget,
                    max_num_batched_tokens=config.max_num_batched_tokens,
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
        quantization=weights_format(model),
        cpu_step=target_model.cpu_step,
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
    prefix_caching: bool = True, layout: KVLayout | DSALayout | None = None,
) -> PoolCosts:
    """Bytes per position of the loaded pair's KV pool, as the runners allocate it (target attention layers' K and
    V, the draft's layers' K and V in the same block ids), a hybrid's recurrent state per running request (with
    `prefix_caching`, its checkpoint copies and the checkpoint store too), and the block + 1 positions a request may
    reach beyond max_model_len (the runners' max_len). `layout`: the generic runner's probed caches (their own
    head counts and dims, shared caches once), which its target rows are counted from."""
    nbytes = torch.tensor([], dtype=dtype).element_size()
    shape = normalize_shape(model.config.to_dict())
    draft_row = 0
    if draft_cfg is not None:
        draft_row = 2 * draft_cfg.num_hidden_layers * draft_cfg.num_key_value_heads * int(draft_cfg.head_dim) * nbytes
    target_row = layout.bytes_per_row(nbytes) if layout is not None else kv_bytes_per_row(shape, nbytes)
    return PoolCosts(target_row, draft_row, kv_block=kv_block, extra_len=block + 1,
                     **pool_state_costs(shape, nbytes, prefix_caching, verify_tokens=block))


@dataclass
class BackendChoice:
    """The target runner `backend` resolves to for a model: its class, and for the generic runner its probed
    cache layout (the memory plan sizes the pool from it)."""

    runner: type[TargetRunner]
    layout: KVLayout | DSALayout | None = None

    @property
    def paged(self) -> bool:
        """Whether the runner has a KV pool to plan (hf has none)."""
        return self.runner is not HFTarget


def choose_backend(model: Any, backend: str) -> BackendChoice:
    """The runner for `backend`: native (our own forward: Qwen3, Llama, Qwen2, Qwen3-MoE, the hybrids), generic (any
    attention-only transformers decoder through the attention interface), hf, or auto: native where it runs the
    model, else generic, else hf. ValueError (one line) when the named backend cannot run the model, or none can
    (layers whose state no cache here rolls back). auto logs its choice and why once."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose {', '.join(BACKENDS)}")
    model_type = model.config.model_type
    kinds = set(getattr(model.config.get_text_config(), "layer_types", None) or [])
    runner, native_reason = native_runner(model)
    if model_type in HYBRID_MODEL_TYPES and (backend in ("hf", "generic") or runner is None):
        # transformers' cache for these layers cannot be cropped, so a rejected draft could not be rolled back
        raise ValueError(f"model_type {model_type!r} (Gated DeltaNet layers) runs on the native backend "
                         f"only: {'use backend native or auto' if runner else native_reason}")
    if backend == "native":
        if runner is None:
            raise ValueError(f"the native backend does not support {native_reason}; use backend generic or auto")
        return BackendChoice(runner)
    recurrent = sorted(kinds - set(ATTENTION_LAYER_TYPES) - {"chunked_attention"})
    if recurrent and runner is None:  # state outside any KV cache: a rejected draft could not be rolled back
        raise ValueError(f"model_type {model_type!r} has layers of kind {', '.join(recurrent)}, whose state no "
                         f"backend here rolls back, so dflash-serve does not serve it")
    if backend == "hf":
        if "indexed_attention" in kinds:  # the indexer's key cache needs transformers' indexed cache layers
            raise ValueError(f"model_type {model_type!r} (DeepSeek sparse attention) runs on the generic backend only: "
                             f"use backend generic or auto")
        return BackendChoice(HFTarget)
    if backend == "auto" and runner is not None:
        log.info("backend auto: native (our own forward of %s)", model_type)
        return BackendChoice(runner)
    try:
        layout = layout_of(model)
    except ValueError as exc:
        if backend == "generic":
            raise ValueError(f"the generic backend cannot run model_type {model_type!r}: {exc}; use backend "
                             f"hf") from exc
        log.info("backend auto: hf, one request per forward (native does not support %s; generic: %s)",
                 native_reason, exc)
        return BackendChoice(HFTarget)
    if backend == "auto":
        log.info("backend auto: generic, batched through transformers' attention interface (native does not "
                 "support %s)", native_reason)
    return BackendChoice(GenericTarget, layout)


def memory_budget(
    config: EngineConfig, model: Any, draft_cfg: DraftConfig | None, device: torch.device, dtype: torch.dtype,
    block: int, choice: BackendChoice | None = None,
) -> MemoryBudget:
    """The start-up memory plan: the KV pool from --kv-cache-memory, else on CUDA --gpu-memory-utilization (0.9
    by default) less the weights, an activation reserve and the widest step's logits, else a share of the free RAM
    (`ram_cache_budget`); ValueError when one request of max_model_len cannot fit (it says what would). Runs after
    the target's weights load and before the caches and the draft's weights are allocated (the draft is counted
    from its shape). `choice`: the target's runner (default: `config.backend`'s)."""
    choice = choice or choose_backend(model, config.backend)
    nbytes = torch.tensor([], dtype=dtype).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    draft_weights = 0
    if draft_cfg is not None:
        with torch.device("meta"):
            draft_weights = sum(p.numel() for p in DFlashDraft(draft_cfg).parameters()) * nbytes
    weights += draft_weights
    slots = config.max_running_requests
    text = model.config.get_text_config()  # a multimodal checkpoint keeps its vocabulary there
    model_max = max_positions(model)
    check_max_model_len(config.max_model_len, longest_allowed(model))
    if not choice.paged:
        if config.kv_cache_memory is not None or config.gpu_memory_utilization is not None:
            log.warning("the hf backend has no KV pool: --kv-cache-memory / --gpu-memory-utilization are not applied")
        return no_pool(weights, slots, config.max_model_len or model_max, config.kv_block_size)
    costs = pool_costs(model, draft_cfg, dtype, block, config.kv_block_size, config.enable_prefix_caching,
                       choice.layout)
    if config.kv_cache_memory is not None:
        cache_budget, source = parse_bytes(config.kv_cache_memory), f"--kv-cache-memory {config.kv_cache_memory}"
    elif device.type == "cuda":
        utilization = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        free, total = torch.cuda.mem_get_info(device)
        tree_rows = config.tree_budget + 1 if config.speculation == "tree" else 0
        logits = verify_logits_bytes(slots, block, int(text.vocab_size), config.max_num_batched_tokens, tree_rows)
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
    model: Any, layer_ids: list[int] | None, backend: str | BackendChoice, max_slots: int,
    max_model_len: int | None, block: int, static: StaticShapes | None = None, num_blocks: int | None = None,
    kv_block: int = 16,
) -> TargetRunner:
    """The target runner for `backend` (a name, resolved by `choose_backend`, or its choice). A paged runner's KV
    pool has `num_blocks` blocks of `kv_block` positions (None: every slot at full length, the runners' default)."""
    choice = choose_backend(model, backend) if isinstance(backend, str) else backend
    runner = choice.runner
    if runner is HFTarget:
        return HFTarget(model, layer_ids)
    max_len = (max_model_len or max_positions(model)) + block + 1
    paging = dict(max_slots=max_slots, max_len=max_len, num_blocks=num_blocks, kv_block=kv_block)
    if runner is GenericTarget:
        if static is not None:
            log.info("compile: the generic runner's steps run eagerly")
        return GenericTarget(model, layer_ids, layout=choice.layout, **paging)
    if runner is HybridTarget:
        if static is not None:  # its recurrent layers record per-row state for rollback, in Python
            log.info("compile: the hybrid runner's steps run eagerly")
        return HybridTarget(model, layer_ids, **paging)
    return NativeTarget(model, layer_ids, static=static, **paging)
