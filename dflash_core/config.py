"""Configuration: a DFlash draft's `config.json` (z-lab layout) and the engine's settings (`EngineConfig`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash_core.kv.pool import DEFAULT_KV_BLOCK
from dflash_core.quant.formats import LOAD_TIME_METHODS
from dflash_core.speculation import POLICIES

DRAFT_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab rule: `num_draft_layers` target layer ids spread evenly over 1 .. L-3."""
    if num_draft_layers < 1:
        raise ValueError("num_draft_layers must be at least 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def read_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """`rope_theta` and the RoPE parameters of a config dict: transformers' `rope_parameters`, or the legacy
    `rope_scaling` with `rope_theta` / `partial_rotary_factor` at top level. None for plain full-rotary RoPE.

    An unknown or refused type is a ValueError naming the field it came from.
    """
    from dflash_core.layers import rope_type, rope_type_error  # torch loads only once a draft is read

    source = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"  # transformers' precedence
    rope = dict(raw.get(source) or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"draft config.json {source}: one RoPE per layer type is not supported")
    theta = next(float(t) for t in (raw.get("rope_theta"), rope.get("rope_theta"), 1_000_000.0) if t is not None)
    kind = rope_type(rope)
    error = rope_type_error(kind)
    if error:
        name = f"{source}.rope_type" if "rope_type" in rope else f"{source}.type"
        raise ValueError(f"draft config.json {name}: {error}")
    params = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    params["rope_type"] = kind
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", float(raw["partial_rotary_factor"]))
    if kind in ("llama3", "yarn", "longrope") and raw.get("original_max_position_embeddings") is not None:
        # transformers gives a top-level original_max_position_embeddings priority (Phi-3 style configs)
        params["original_max_position_embeddings"] = int(raw["original_max_position_embeddings"])
    if kind == "default" and float(params.get("partial_rotary_factor") or 1.0) == 1.0:
        return theta, None
    return theta, params


@dataclass(frozen=True)
class DFlash2Config:
    """The `dflash_config` keys a DFlash 2 draft adds."""

    conv_kernel_size: int  # taps K of the convolution
    conv_group_size: int  # channels sharing one dynamic kernel
    selector_rank: int  # rank r of the selector's codebooks
    selector_top_k: int  # candidates per position

    def check(self, hidden_size: int, vocab_size: int, draft_vocab_size: int | None) -> None:
        """ValueError naming the field when this config cannot describe a draft of these sizes."""
        for name in DFLASH2_KEYS:
            if getattr(self, name) < 1:
                raise ValueError(f"draft config.json dflash_config.{name} must be >= 1, got {getattr(self, name)}")
        if hidden_size % self.conv_group_size:
            raise ValueError(f"draft config.json dflash_config.conv_group_size {self.conv_group_size} does not "
                             f"divide hidden_size {hidden_size}")
        if self.selector_top_k > vocab_size:
            raise ValueError(f"draft config.json dflash_config.selector_top_k {self.selector_top_k} exceeds "
                             f"vocab_size {vocab_size}")
        if draft_vocab_size is not None:
            raise ValueError(f"draft config.json draft_vocab_size {draft_vocab_size}: a DFlash 2 draft proposes "
                             "over the target's whole vocabulary (its selector's codebooks are indexed by it)")


DFLASH2_KEYS = tuple(f.name for f in fields(DFlash2Config))  # the `dflash_config` keys a DFlash 2 draft adds


def read_dflash2_config(dflash: dict[str, object]) -> DFlash2Config:
    """The DFlash 2 keys of a config's `dflash_config`; ValueError naming a missing one."""
    values = {}
    for name in DFLASH2_KEYS:
        value = dflash.get(name)
        if value is None:
            raise ValueError(f"draft config.json lacks dflash_config.{name} (a DFlash 2 draft needs it)")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"draft config.json dflash_config.{name} must be an integer, got {value!r}")
        values[name] = value
    return DFlash2Config(**values)  # type: ignore[arg-type]


@dataclass
class DraftConfig:
    """The fields of a z-lab DFlash draft `config.json` that the draft model uses."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_target_layers: int | None  # None: the format does not say (speculators)
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None  # a reduced vocabulary with the draft's own head (None: the target's head)
    dflash2: DFlash2Config | None = None  # a DFlash 2 draft's convolution and candidate selector (None: DFlash)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.target_layer_ids:
            if self.num_target_layers is None:
                raise ValueError("draft config needs target_layer_ids or num_target_layers")
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.draft_vocab_size is not None and int(self.draft_vocab_size) == self.vocab_size:
            self.draft_vocab_size = None  # the full vocabulary: the target's own head
        if self.dflash2 is not None:
            self.dflash2.check(self.hidden_size, self.vocab_size, self.draft_vocab_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DraftConfig:
        """Read a z-lab config dict; `block_size` may sit at top level or in `dflash_config`."""
        dflash = dict(raw.get("dflash_config") or {})

        def pick(name: str, default: Any = None) -> Any:
            return dflash.get(name, raw.get(name, default))

        required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ValueError(f"draft config.json lacks required field(s): {', '.join(missing)}")
        if pick("mask_token_id") is None:
            raise ValueError("draft config.json lacks dflash_config.mask_token_id")
        if raw.get("num_target_layers") is None and pick("target_layer_ids") is None:
            raise ValueError("draft config.json needs num_target_layers or dflash_config.target_layer_ids")
        rope_theta, rope_scaling = read_rope(raw)
        layer_ids = pick("target_layer_ids")
        num_target_layers = raw.get("num_target_layers") or (max(layer_ids) + 4)
        return cls(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=int(num_target_layers),
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(pick("mask_token_id")),
            target_layer_ids=[int(i) for i in layer_ids] if layer_ids else [],
            head_dim=raw.get("head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            layer_types=raw.get("layer_types"),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            is_causal=raw.get("is_causal"),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=pick("final_logit_softcapping"),
            draft_vocab_size=None if raw.get("draft_vocab_size") is None else int(raw["draft_vocab_size"]),
            dflash2=read_dflash2_config(dflash) if DFLASH2_ARCHITECTURE in (raw.get("architectures") or []) else None,
            extra={k: v for k, v in raw.items() if k in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype")},
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DraftConfig:
        """Load `config.json` from a draft folder (or the file itself)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        raw = json.loads(path.read_text())
        archs = raw.get("architectures") or []
        if DRAFT_ARCHITECTURE not in archs and DFLASH2_ARCHITECTURE not in archs:
            raise ValueError(f"{path}: architectures is {archs}, expected ['{DRAFT_ARCHITECTURE}'] or "
                             f"['{DFLASH2_ARCHITECTURE}']")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The z-lab `config.json` layout (what a published DFlash checkpoint carries)."""
        d = asdict(self)
        d.pop("extra")
        dflash2 = d.pop("dflash2")
        out: dict[str, Any] = {
            "architectures": [DRAFT_ARCHITECTURE if dflash2 is None else DFLASH2_ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": d.pop("block_size"),
            "dflash_config": {
                "mask_token_id": d.pop("mask_token_id"),
                "target_layer_ids": d.pop("target_layer_ids"),
                **(dflash2 or {}),
            },
        }
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            value = d.pop(name)
            if name == "final_logit_softcapping" and value is None:
                continue
            if name != "final_logit_softcapping" and value == 1.0:
                continue
            out["dflash_config"][name] = value
        if d["is_causal"] is None:
            d.pop("is_causal")
        if d["draft_vocab_size"] is None:
            d.pop("draft_vocab_size")
        d["use_sliding_window"] = d["sliding_window"] is not None
        d["layer_types"] = d["layer_types"] or ["full_attention"] * self.num_hidden_layers
        out.update(d)
        out.update(self.extra)
        out.setdefault("dtype", "float32")
        return out

    def first_difference(self, other: DraftConfig) -> str | None:
        """The first field (and both values) in which `other` describes another network than this config, or None
        when the two describe the same shapes and computation (`extra`, the fields the draft does not use, aside)."""
        for f in fields(self):
            if f.name in ("extra", "num_target_layers"):  # the target's depth: a note at start-up, not a shape
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "layer_types":  # None: every layer full attention
                mine, theirs = self.attention_layers(), other.attention_layers()
            if mine != theirs:
                return f"{f.name} ({mine!r} -> {theirs!r})"
        return None

    def attention_layers(self) -> list[str]:
        """Each layer's attention type (`layer_types`, every layer "full_attention" when the config has none)."""
        return list(self.layer_types or ["full_attention"] * self.num_hidden_layers)

    def save(self, folder: str | Path) -> None:
        """Write `config.json` into `folder`."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


BACKENDS = ("auto", "native", "generic", "hf")
MAX_TREE_BUDGET = 256  # a tree's nodes at most: the verify row is one request's, and its logits grow with it
SPEC_SAMPLING = ("keyed", "rejection")  # how a sampled request accepts draft tokens (`dflash_core.rejection`)
COMPILE_SCOPES = ("layer", "step")  # what one compiled graph holds (`dflash_core.compile.default_scope`)


def parse_sizes(text: str | Sequence[int] | None, name: str) -> tuple[int, ...] | None:
    """`"1,4,16"` (or a sequence) as sorted distinct sizes >= 1; None stays None (ValueError naming `name`)."""
    if text is None:
        return None
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()] if isinstance(text, str) else [int(x) for x in text]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{name} must be integers >= 1, got {text!r}")
    return tuple(sorted(set(sizes)))


def _setting(default: Any, help: str) -> Any:
    """A field whose help text the server's command line (and the docs) show."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting: what to load, where, and how many requests run at once.

    Frozen: built once (by `LLM(...)`, the server's settings or a benchmark) and handed to `load_models`.
    The server's `Settings` extend it with the HTTP settings; field names are the YAML keys and flags there.
    """

    target: str | None = _setting(None, "target model folder or hub id (default: the bundled demo target)")
    draft: str | None = _setting(None, "DFlash draft folder or hub id (default: the demo draft, with the demo target)")
    tokenizer: str | None = _setting(None, "tokenizer (default: the target's)")
    device: str = _setting("auto", "auto, cpu, cuda, cuda:N")
    dtype: str = _setting("auto", "auto, float32, bfloat16, float16")
    quantization: str | None = _setting(
        None, "quantize a full-precision target's linear weights while loading: fp8 (e4m3, 128x128 block scales, "
        "as Qwen's FP8 checkpoints) or int4 (4-bit codes with a scale and zero point per 128 inputs, GPTQ's "
        "layout); a quantized checkpoint (FP8, GPTQ, AWQ, compressed-tensors, MXFP4) is read as it is without this "
        "flag (default: the checkpoint's own weights)")
    backend: str = _setting(
        "auto", "target forward: native (our own batched forward over the paged KV pool; Qwen3, Llama, Qwen2, "
        "Qwen3-MoE and the hybrids Qwen3.5, Qwen3.5-MoE, Qwen3-Next), generic (any attention-only transformers "
        "decoder batched over the paged KV pool through transformers' attention interface; e.g. Gemma 4, gpt-oss, "
        "DeepSeek-V3 / Kimi, GLM-4.5 / GLM-5, MiniMax-M2, Mistral, Phi-3), hf (transformers, one request per "
        "forward), auto (native where it runs the target, else generic, else hf)")
    block_size: int | None = _setting(
        None, "DFlash draft block size: tokens per draft-and-verify block (the KV cache's block is --kv-block-size) "
        "(default: the draft's)")
    speculative: bool = _setting(
        True, "DFlash speculative decoding; --no-speculative serves the target autoregressively")
    max_running_requests: int = _setting(
        256, "the running-request cap (vLLM's --max-num-seqs, same default): at most this many requests decode at "
        "once; the KV pool decides how many of them fit (the rest wait, and a request is preempted and recomputed "
        "when blocks run out)")
    max_model_len: int | None = _setting(
        None, "context length limit, prompt plus output (default: the model's, lowered to what one request can "
        "hold when the KV pool is smaller; a longer one than the model's is refused unless "
        "DFLASH_ALLOW_LONG_MAX_MODEL_LEN=1)")
    kv_block_size: int = _setting(
        DEFAULT_KV_BLOCK, "positions per KV-cache block (vLLM's --block-size; here --block-size is the DFlash draft "
        "block): the unit a request's KV grows by and prefix caching reuses; a power of two <= 256")
    enable_prefix_caching: bool = _setting(
        True, "automatic prefix caching: full KV blocks are kept, keyed by their tokens and prefix, and a request "
        "whose prompt starts with cached blocks prefills only the rest (--no-enable-prefix-caching: off)")
    draft_window: int | None = _setting(
        None, "the draft attends only to the last N target-context positions (its KV stays in the pool's pages); "
        "outputs are unchanged, acceptance changes (default: all positions)")
    compile: bool | None = _setting(
        None, "pad decode steps (verify, plain, draft) to static shapes and torch.compile them, with CUDA graphs on "
        "CUDA (default: on for CUDA, off on CPU)")
    compile_batch_sizes: str | None = _setting(
        None, "batch buckets of the compiled step, comma-separated; bigger batches run eagerly, a bucket of 1 runs "
        "as 2 (one compiled graph for every bucket) (default: powers of two from 2 up to "
        "min(max_running_requests, 64), and that number: a CUDA graph per bucket and key length, so 256 running "
        "requests do not mean compiling and holding 256-row graphs)")
    compile_widths: str = _setting("2,4,8,16", "tokens-per-row buckets of the compiled step, comma-separated; a "
                                   "plain step (1 token) runs in the bucket of 2 (one compiled graph for every bucket)")
    compile_scope: str | None = _setting(
        None, "what one compiled graph holds: layer (one graph for a layer kind, which every layer calls with its "
        "own weights and caches: compiles a layer once, not once per layer) or step (the whole step: one CUDA graph "
        "replays it) (default: step on CUDA, layer elsewhere)")
    compile_cache: str | None = _setting(
        None, "directory of the on-disk compile cache (inductor's; TORCHINDUCTOR_CACHE_DIR): keep it across restarts "
        "and a restart with --compile reuses the compiled graphs (default: torch's, under the temp directory)")
    kv_cache_memory: str | None = _setting(
        None, "bytes for the KV pool (target and draft blocks) and a hybrid's recurrent states (4GiB, 4GB or an "
        "integer); one request of max_model_len must fit, else start-up is refused (default: on CUDA see "
        "--gpu-memory-utilization; elsewhere a quarter of the available RAM, at most 1 GiB: CPU decoding is "
        "compute-bound at a few streams, and the pool is zero-filled at start-up)")
    gpu_memory_utilization: float | None = _setting(
        None, "CUDA: the fraction of the card's memory to use; the KV pool gets it less the weights, an "
        "activation reserve and the logits of the widest step (default: 0.9 unless --kv-cache-memory is set, "
        "as vLLM)")
    speculation: str = _setting(
        "adaptive", "verify width policy: adaptive (per step, from the draft's confidence and the measured step "
        "costs: narrower under load, plain steps where drafting does not pay, a tree where it pays more than the "
        "chain), fixed (always the full block) or tree (a tree of the tree budget's draft nodes every step, where "
        "the backend verifies trees)")
    tree_budget: int = _setting(
        32, "the most draft nodes a verified tree holds: the top prefixes of the draft's per-position candidates, "
        "verified in one row (native backend, DFlash drafts, requests without logits processing; --speculation "
        "tree: every tree's size; adaptive: the largest it weighs; 0: chains only; at most 256)")
    spec_sampling: str = _setting(
        "keyed", "how a sampled request (temperature > 0) accepts draft tokens: keyed (the target's own "
        "position-keyed draw must equal the draft's token: seeded text is the same with and without speculation) "
        "or rejection (the draft's tokens drawn from its distribution and accepted with probability min(1, p/q), "
        "the residual drawn on a rejection: the target's distribution exactly, more tokens accepted when the draft's "
        "distribution is close to the target's, seeded text depends on the speculation; requests with structured "
        "output stay keyed)")
    max_num_batched_tokens: int | None = _setting(
        2048, "token budget of one engine step: prefill chunks plus verify tokens; as vLLM's")
    prefill_chunk: int | None = _setting(
        256, "most prompt tokens prefilled per step, over all new requests (fewer while streams decode: what a "
        "measured half decode step allows), so a long prompt delays running streams a fraction of a step at a "
        "time (0: whole prompts)")
    threads: int | None = _setting(
        None, "torch CPU threads (default: 1 on a CPU device, where small forwards are fastest on one thread; "
        "torch's default on CUDA)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the impossible setting."""
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_block_size < 1 or self.kv_block_size > 256 or self.kv_block_size & (self.kv_block_size - 1):
            # a power of two: the compiled steps' key buckets (powers of two >= 256) split into whole blocks
            raise ValueError(f"kv_block_size must be a power of two in 1..256, got {self.kv_block_size}")
        if self.draft_window is not None and self.draft_window < 1:
            raise ValueError("draft_window must be >= 1")
        from dflash_core.memory import parse_bytes

        parse_sizes(self.compile_batch_sizes, "compile_batch_sizes")
        parse_sizes(self.compile_widths, "compile_widths")
        if self.kv_cache_memory is not None:
            try:
                parse_bytes(self.kv_cache_memory)
            except ValueError as exc:
                raise ValueError(f"kv_cache_memory: {exc}") from None
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError("gpu_memory_utilization must be in (0, 1]")
            if self.kv_cache_memory is not None:
                raise ValueError("set one of kv_cache_memory and gpu_memory_utilization, not both")
        if self.compile_scope not in (None, *COMPILE_SCOPES):
            raise ValueError(f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}, got {self.compile_scope!r}")
        if self.speculation not in POLICIES:
            raise ValueError(f"speculation must be one of {', '.join(POLICIES)}, got {self.speculation!r}")
        if (isinstance(self.tree_budget, bool) or not isinstance(self.tree_budget, int)
                or not 0 <= self.tree_budget <= MAX_TREE_BUDGET):
            raise ValueError(f"tree_budget must be an integer from 0 to {MAX_TREE_BUDGET}, got {self.tree_budget!r}")
        if self.speculation == "tree" and not self.tree_budget:
            raise ValueError("speculation tree needs a tree_budget of at least 1")
        if self.spec_sampling not in SPEC_SAMPLING:
            raise ValueError(f"spec_sampling must be one of {', '.join(SPEC_SAMPLING)}, got {self.spec_sampling!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_running_requests:
            raise ValueError("max_num_batched_tokens must exceed max_running_requests (every running request "
                             "verifies at least one token per step)")
        if self.prefill_chunk is not None and self.prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0 (0: whole prompts)")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.quantization is not None and self.quantization not in LOAD_TIME_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(LOAD_TIME_METHODS)}, got {self.quantization!r}")

    @classmethod
    def from_settings(cls, settings: Any) -> EngineConfig:
        """The engine part of a config that extends this one (the server's settings)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def uses_demo_pair(self) -> bool:
        """No target named: the bundled demo pair is loaded."""
        return self.target is None
