"""Sampling parameters, processed distributions and position-keyed sampling.

Every sampled token is a Gumbel-max draw (an exponential race) keyed by (seed, position, token id): with p the
processed distribution of the row and E_i = -log u_i, where u_i in (0, 1) is a pure function of (seed, position, i)
(`token_uniform`), the token is the argmax of p_i / E_i over the tokens with p_i > 0 (the same as the argmax of
log p_i - log(-log u_i)); it follows p exactly. The token at a position is then the same function of the target's
distribution whether it was reached by plain decoding or by verifying a draft block, so a seeded request gives the
same text with and without speculation, and a request's randomness never depends on what else runs. Logits computed
by another forward (another prefill chunk, a prefix-cache hit, a recompute, a verify block) differ by ~1e-6; the
draw changes only when the two best perturbed scores are that close (probability ~1e-6 per token), where an
inverse-CDF draw would flip whenever its uniform fell within ~1e-6 of any of the V cumulative boundaries.
"""

from __future__ import annotations

import math
import random
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_core.grammar import StructuredOutput
from dflash_core.transfer import HostToDevice, to_host

MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's rule): logits / t would overflow to inf / NaN
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    """Per-request decoding settings (OpenAI semantics; top_k 0 or -1 disables it).

    The logits controls follow vLLM: presence / frequency penalties count OUTPUT tokens, the repetition penalty
    prompt + output tokens; `logit_bias` maps token ids to a bias in [-100, 100]; `min_p` keeps tokens whose
    probability is at least min_p times the top one; `min_tokens` bans the stop tokens (EOS, stop_token_ids) until
    that many tokens were generated. `structured` constrains the output with a grammar. All default to neutral.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)  # texts that end the output before them (the detokenizer's job)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, as vLLM's SamplingParams takes it
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one so small that dividing by it overflows (< SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative token ids")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias must map non-negative token ids to biases")
        if any(not _is_real(b) or not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError("structured must be a dflash_core.grammar.StructuredOutput")
            self.structured.validate()


def _is_real(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def resolve_seed(seed: int | None) -> int:
    """The request's seed, or a fresh random one."""
    return random.getrandbits(63) if seed is None else int(seed) & _MASK64


_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment and its finaliser's multipliers
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _mix_host(z: int) -> int:
    """splitmix64's finaliser on a Python int (64 bits)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def token_uniform(seed: int, position: int, token: int) -> float:
    """The uniform number in (0, 1) that the draw of `token` at `position` uses, a pure function of the three
    (host reference of `token_uniforms`). key = mix(seed + (position + 1) * G) and h = mix(key + (token + 1) * G)
    mod 2^64, with mix splitmix64's finaliser and G its increment; u = (h >> 12 + 1/2) / 2^52: the top 52 bits of
    h, centred in their bin, so never 0 and never 1."""
    key = _mix_host((seed + (position + 1) * _GOLDEN) & _MASK64)
    h = _mix_host((key + (token + 1) * _GOLDEN) & _MASK64)
    return ((h >> 11) | 1) / float(1 << 53)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, then top-k, then top-p (vLLM order); rows renormalised. logits [n, V] -> probs [n, V]
    fp32. min-p drops the tokens whose probability (after temperature) is below min_p times the row's top one.

    top-k keeps every token whose scaled logit is >= the k-th largest, so ties at the k-th value are all kept (as
    vLLM does). top-p keeps, in order of decreasing probability (ties: lower token id first), each token whose
    preceding mass is < top_p, so the token that crosses top_p is kept and the most likely token always is.
    A greedy request (temperature < SAMPLING_EPS) gets a one-hot at the argmax; the result never holds NaN.
    """
    logits = logits.float()
    onehot = torch.zeros_like(logits).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if params.greedy:
        return onehot
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * params.min_p, float("-inf"))
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p
        keep[..., 0] = True
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    # Guard: a row that still went non-finite (inf logits from the model) falls back to its argmax.
    bad = ~torch.isfinite(probs).all(dim=-1, keepdim=True)
    return torch.where(bad, onehot, probs)


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic), as a new tensor."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bits, in place (the products wrap modulo 2^64 as the host's masked ones)."""
    z ^= _shr(z, 30)
    z *= _signed(_MIX1)
    z ^= _shr(z, 27)
    z *= _signed(_MIX2)
    z ^= _shr(z, 31)
    return z


def _uniforms(keys: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """`token_uniform` of the tokens start .. stop - 1 for rows with keys int64 [R, 1] -> float64 [R, stop - start]."""
    tokens = torch.arange(start + 1, stop + 1, device=keys.device, dtype=torch.int64) * _signed(_GOLDEN)
    h = _mix_(keys + tokens)
    # (h >> 12 + 1/2) / 2^52 = ((h >> 11) | 1) / 2^53: exact in float64 (53 bits), strictly inside (0, 1)
    return _shr(h, 11).bitwise_or_(1) * torch.full((), 2.0 ** -53, dtype=torch.float64, device=h.device)


def _keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's key mix(seed + (position + 1) * G) (int64 [R] each -> [R, 1])."""
    return _mix_((positions + 1) * _signed(_GOLDEN) + seeds)[:, None]


def token_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """`token_uniform(seed, position, token)` for every row and every token < vocab: seeds and positions int64 [R]
    (a seed as the int64 with its bits), on their device -> float64 [R, vocab], bit for bit the host's."""
    return _uniforms(_keys(seeds, positions), 0, vocab)


_CPU_SLICE = 1 << 16  # elements of [rows, V] per slice of a draw on the CPU: cache-resident, about twice as fast
# elements of [rows, V] per draw at most (more: slices of rows): on an accelerator, where a draw is one pass over the
# vocabulary, its int64 / float64 temporaries (about 3.5 x 8 bytes an element) stay near 0.5 GB beside the logits
# whatever the step's rows (2,048 x 151,936 at once would take ~9 GB)
_DRAW_ELEMENTS = 1 << 24


def race_choice(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max draw of each row of probs [R, V] (processed, finite): row r picks the argmax of p_i / E_i over
    the tokens with p_i > 0, with E_i = -log token_uniform(seeds[r], positions[r], i) (seeds, positions int64 [R]).

    Computed as the argmin of p_i / log u_i (= -p_i / E_i): a zero-probability token scores 0 and never wins, since
    a row's most likely token (p >= 1/V) scores below 0. One pass over the vocabulary on an accelerator; on the CPU
    in slices of columns that stay in cache, the first minimum kept across slices (the same token as one argmin);
    and in slices of rows beyond `_DRAW_ELEMENTS` elements (each row's draw is its own).
    """
    rows, vocab = probs.shape
    if rows * vocab > _DRAW_ELEMENTS:  # a bounded workspace: slices of rows
        step = max(1, _DRAW_ELEMENTS // vocab)
        return torch.cat([race_choice(probs[i : i + step], seeds[i : i + step], positions[i : i + step])
                          for i in range(0, rows, step)])
    keys = _keys(seeds, positions)
    width = max(1, _CPU_SLICE // max(rows, 1)) if probs.device.type == "cpu" else vocab
    best = choice = None
    for start in range(0, vocab, width):
        stop = min(vocab, start + width)
        score, at = torch.div(probs[:, start:stop], _uniforms(keys, start, stop).log_()).min(dim=-1)
        if best is None:
            best, choice = score, at
        else:
            better = score < best  # strictly: on a tie the earlier token stays, as argmin does
            best, choice = torch.where(better, score, best), torch.where(better, at + start, choice)
    return choice


def inverse_cdf_choice(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A draw of each row of probs [R, V] (non-negative, not all zero; unnormalised is fine) by its cumulative sum and
    ONE uniform, `token_uniform(seeds[r], positions[r], 0)`: the first token whose cumulative mass exceeds u times
    the row's total (never a zero-probability one). A cumulative sum instead of V hashes, so much cheaper than
    `race_choice`, but a tiny change of the probabilities can move it: for draws whose text is not kept
    reproducible across forwards (a draft's proposals, a rejection's residual), never for the target's tokens."""
    cum = probs.double().cumsum(dim=-1)
    u = _uniforms(_keys(seeds, positions), 0, 1)  # [R, 1] in (0, 1): below the total, so an index < V
    return torch.searchsorted(cum, u * cum[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def choose_token_tensor(logits: torch.Tensor, params: SamplingParams, seed: int, first_position: int) -> torch.Tensor:
    """The target's own choice for each row of logits [n, V], on the logits' device (no transfer): row i picks
    the token at `first_position + i`, with that position's noise (`race_choice`)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = processed_probs(logits, params)
    n = logits.shape[0]
    seeds = torch.full((n,), _signed(seed & _MASK64), device=probs.device, dtype=torch.int64)
    positions = torch.arange(first_position, first_position + n, device=probs.device, dtype=torch.int64)
    return race_choice(probs, seeds, positions)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, seed: int, first_position: int) -> list[int]:
    """`choose_token_tensor`, on the host (one counted transfer)."""
    return to_host(choose_token_tensor(logits, params, seed, first_position))


def float_bits(value: float) -> int:
    """The bits of a float64 as an int64 (to travel with integer arrays; `.view(torch.float64)` reads it back)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def filters_used(params: Sequence[SamplingParams]) -> dict[str, bool]:
    """`processed_rows`' switches for rows with these parameters: a filter no row uses is skipped."""
    return dict(use_min_p=any(p.min_p > 0.0 for p in params), use_top_k=any(p.top_k > 0 for p in params),
                use_top_p=any(p.top_p < 1.0 for p in params))


def processed_rows(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, *, use_min_p: bool = True, use_top_k: bool = True,
                   use_top_p: bool = True) -> torch.Tensor:
    """`processed_probs` for many rows at once, each with its own parameters: logits [S, V] fp32 and a parameter per
    row ([S] each; temperature / min_p / top_p float32, top_k int64) -> probs [S, V]. Every operation is row-wise and
    the same as `processed_probs`'; a filter whose `use_*` is False is off in every row (the host knows) and
    skipped."""
    vocab = logits.shape[-1]
    onehot = torch.zeros_like(logits).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    scores = logits / temperature[:, None]
    if use_min_p:  # a row with min_p 0 drops nothing (probs < 0 never holds)
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], float("-inf"))
    if use_top_k:  # the k-th largest value of each row with 0 < k < V, else -inf (keeps all)
        active = (top_k > 0) & (top_k < vocab)
        ordered = scores.sort(dim=-1, descending=True).values
        kth = ordered.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])
        kth = torch.where(active[:, None], kth, torch.full_like(kth, float("-inf")))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if use_top_p:  # rows with top_p 1 keep their probabilities bit for bit
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]
        keep[..., 0] = True
        nucleus = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        nucleus = nucleus / nucleus.sum(-1, keepdim=True)
        probs = torch.where((top_p < 1.0)[:, None], nucleus, probs)
    bad = ~torch.isfinite(probs).all(dim=-1, keepdim=True)
    return onehot.where(bad, probs)


def race_among(probs: torch.Tensor, token_ids: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
    """The Gumbel-max draw of each row among some tokens only: probs [R, K] of the tokens token_ids [R, K] (int64,
    distinct in a row) -> the index [R] in K of the winner. Each token uses its own `token_uniform`, so a row whose
    K tokens hold all its mass draws the same token as `race_choice` of the whole row."""
    keys = _keys(seeds, positions)
    h = _mix_(keys + (token_ids + 1) * _signed(_GOLDEN))
    u = _shr(h, 11).bitwise_or_(1) * torch.full((), 2.0 ** -53, dtype=torch.float64, device=h.device)
    return torch.div(probs, u.log_()).argmin(dim=-1)


@dataclass
class Block:
    """One request's rows of a step: raw logits [n, V], row i choosing the token at `first_position + i`, and its
    processor (`dflash_core.processors`) with the history it processes against. With `rejection` (a sampled
    request under `--spec-sampling rejection`) the rows of its draft tokens are decided by
    `dflash_core.rejection.rejection_choices` against `dist`, the draft's distributions [len(draft), V] the tokens
    were drawn from (None: proposed deterministically)."""

    logits: torch.Tensor
    params: SamplingParams
    seed: int
    first_position: int
    processor: Any = None
    output: Sequence[int] = ()
    draft: Sequence[int] = ()
    rejection: bool = False
    dist: torch.Tensor | None = None
    positions: Sequence[int] | None = None  # each row's position when not first_position + i (a tree's rows)

    @property
    def rejects(self) -> bool:
        """Its draft rows are decided by rejection sampling (a sampled block with draft tokens)."""
        return self.rejection and not self.params.greedy and bool(self.draft)


_local = threading.local()


def staging_for(device: torch.device) -> HostToDevice:
    """This thread's staging buffers for `device` (a step's inputs travel through them)."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    if device not in buffers:
        buffers[device] = HostToDevice(device)
    return buffers[device]


# a top_k at least the vocabulary keeps every token: larger ones travel as this (an int64 column holds it)
TOP_K_ALL = 2**31 - 1


def choose_step(blocks: Sequence[Block | None], staging: HostToDevice | None = None
                ) -> list[list[int] | BaseException]:
    """Every block's choices (None: an empty row list), computed for the whole step at once.

    The processors' inputs and the sampled rows' parameters travel to the device in ONE copy (`staging`), the
    processed rows are stacked (sampled requests first, then greedy ones), greedy rows take their argmax and
    sampled rows their draw (`processed_rows`, `race_choice`; the draft rows of a block that `rejects`:
    `rejection_choices`), and every choice comes back in ONE transfer (`to_host`). A block whose processing raises
    gets its exception; the others are unaffected.
    """
    results: list[list[int] | BaseException] = [[] for _ in blocks]
    live: list[tuple[int, Block, list[Any]]] = []
    for i, block in enumerate(blocks):
        if block is None:
            continue
        try:
            arrays = block.processor.inputs(block.logits, block.output, block.draft) if block.processor else []
            live.append((i, block, arrays))
        except Exception as exc:
            results[i] = exc
    if not live:
        return results
    live.sort(key=lambda item: item[1].params.greedy)  # sampled blocks first: their rows are one slice
    sampled = [(i, b) for i, b, _ in live if not b.params.greedy]
    params: list[list[int]] = [[] for _ in range(5)]  # temperature, min_p, top_p bits; top_k; seed
    positions: list[int] = []
    for _, b in sampled:
        n, p = b.logits.shape[0], b.params
        for column, value in zip(params, (float_bits(p.temperature), float_bits(p.min_p), float_bits(p.top_p),
                                          min(p.top_k, TOP_K_ALL), _signed(b.seed & _MASK64))):
            column.extend([value] * n)
        positions.extend(range(b.first_position, b.first_position + n) if b.positions is None else b.positions)
    arrays = [a for _, _, mine in live for a in mine]
    rejecting: list[int] = []  # sampled blocks whose draft rows rejection sampling decides
    if sampled:
        arrays += [*params, positions]
        rejecting = [i for i, b in sampled if b.rejects]
        arrays += [list(blocks[i].draft) for i in rejecting]  # type: ignore[union-attr]  # what rejection tests
    device = live[0][1].logits.device
    sent = (staging or staging_for(device)).send(*arrays) if arrays else ()
    rows: list[tuple[int, torch.Tensor, int]] = []  # (block, processed rows, first row in the sampled arrays)
    at, row = 0, 0
    for i, block, mine in live:
        k = len(mine)
        try:
            logits = block.logits
            if block.processor is not None:
                logits = block.processor.apply_inputs(logits, block.output, block.draft, sent[at : at + k])
            rows.append((i, logits.float(), row))
        except Exception as exc:
            results[i] = exc
        at += k
        row += block.logits.shape[0] if not block.params.greedy else 0
    try:
        choices = _choose_rows(blocks, rows, sent[at:] if sampled else (), rejecting)
        flat = to_host(choices)
    except Exception as exc:  # the step's computation itself failed: every request still live gets it
        for i, _, _ in rows:
            results[i] = exc
        return results
    at = 0
    for i, logits, _ in rows:
        results[i] = flat[at : at + logits.shape[0]]
        at += logits.shape[0]
    return results


def _choose_rows(blocks: Sequence[Block | None], rows: list[tuple[int, torch.Tensor, int]],
                 sent: Sequence[torch.Tensor], rejecting: Sequence[int] = ()) -> torch.Tensor:
    """The choices of `rows` (sampled blocks first) as one tensor, in their order; `sent` holds the sampled rows'
    parameters, then the draft tokens of the blocks `rejecting` (block indices)."""
    sampled = [(i, x, r) for i, x, r in rows if not blocks[i].params.greedy]  # type: ignore[union-attr]
    greedy = [x for i, x, _ in rows if blocks[i].params.greedy]  # type: ignore[union-attr]
    parts: list[torch.Tensor] = []
    if sampled:
        temperature, min_p, top_p, top_k, seeds, positions = sent[:6]
        live = {i for i, _, _ in sampled}
        drafts = {i: t for i, t in zip(rejecting, sent[6:]) if i in live}  # the rejecting blocks' draft tokens
        total = temperature.shape[0]
        if sum(x.shape[0] for _, x, _ in sampled) != total:  # a sampled block failed: its parameter rows go
            keep = [slice(r, r + x.shape[0]) for _, x, r in sampled]
            temperature, min_p, top_p, top_k, seeds, positions = (
                torch.cat([t[s] for s in keep]) for t in (temperature, min_p, top_p, top_k, seeds, positions))
        ps = [blocks[i].params for i, _, _ in sampled]  # type: ignore[union-attr]
        probs = processed_rows(torch.cat([x for _, x, _ in sampled]), _as_float(temperature), _as_float(min_p), top_k,
                               _as_float(top_p), **filters_used(ps))
        chosen = race_choice(probs, seeds, positions)
        if drafts:
            from dflash_core.rejection import rejection_rows  # it builds on this module's draws

            parts.append(rejection_rows(blocks, sampled, drafts, probs, chosen, seeds, positions))
        else:
            parts.append(chosen)
    if greedy:
        parts.append(torch.cat(greedy).argmax(dim=-1))
    return torch.cat(parts)


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    """float64 bits sent as int64 -> the float32 values (rounded as a Python float becomes a float32 scalar)."""
    return bits.view(torch.float64).float()


def token_logprobs(
    logits: torch.Tensor, chosen: list[int], k: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Log-probabilities of the chosen tokens under the raw model distribution, with the top-k alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(chosen, device=logp.device)
    chosen_lp = logp.gather(-1, idx[:, None])[:, 0].tolist()
    if k > 0:
        top_v, top_i = logp.topk(k, dim=-1)
        tops = [list(zip(ti, tv)) for ti, tv in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [[] for _ in chosen]
    return list(zip(chosen_lp, tops))
