"""Sampling checked against an independent reference written here, not against the engine's own code paths.

`reference_probs` is a plain float64 transcription of the documented rule (temperature, then top-k keeping ties at
the k-th value, then top-p keeping each token whose preceding mass is < top_p in order of decreasing probability,
ties by token id; temperature < 1e-5 is greedy). `reference_decode` is plain autoregressive decoding with it: a
fresh full forward per token and the Gumbel-max draw `gumbel_max` keyed by (seed, position, token id), position being
the token's index in prompt + output, with the noise hash transcribed here in plain Python (`reference_uniform`).
The engine must reproduce it token for token with drafts that are really accepted, and its accepted tokens must
follow the exact target distribution (chi-square goodness of fit).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from dflash_core.engine import Engine
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams, choose_tokens, processed_probs, token_uniforms
from tests.helpers import make_target
from tests.test_engine import OracleDrafter, ScriptedDrafter, predicted_acceptance, run_all, tokens

INF = float("inf")


def reference_probs(logits: Sequence[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The processed distribution of one row, in float64, the obvious way."""
    v = len(logits)
    if temperature < 1e-5:  # greedy: the first maximum
        best = max(range(v), key=lambda t: (logits[t], -t))
        return [1.0 if t == best else 0.0 for t in range(v)]
    scores = [x / temperature for x in logits]
    if 0 < top_k < v:
        kth = sorted(scores, reverse=True)[top_k - 1]
        scores = [s if s >= kth else -INF for s in scores]  # every token tied with the k-th stays
    top = max(scores)
    weights = [math.exp(s - top) if s != -INF else 0.0 for s in scores]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        before = 0.0
        keep = set()
        for t in sorted(range(v), key=lambda t: (-probs[t], t)):
            if before < top_p:
                keep.add(t)
            before += probs[t]
        probs = [p if t in keep else 0.0 for t, p in enumerate(probs)]
        total = sum(probs)
        probs = [p / total for p in probs]
    return probs


GOLDEN = 0x9E3779B97F4A7C15  # splitmix64: the state's increment and the finaliser's constants


def splitmix64_finaliser(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)


def reference_uniform(seed: int, position: int, token: int) -> float:
    """The documented noise: key = splitmix64's first output seeded with seed + position * G, and the token's hash
    h its (token + 1)-th output seeded with key; u = (h // 2^12 + 1/2) / 2^52, so 0 < u < 1."""
    key = splitmix64_finaliser((seed + (position + 1) * GOLDEN) % (1 << 64))
    h = splitmix64_finaliser((key + (token + 1) * GOLDEN) % (1 << 64))
    return (h // 4096 + 0.5) / 2.0**52


def gumbel_max(probs: Sequence[float], seed: int, position: int) -> int:
    """The token with the largest log p - log(-log u) among those with p > 0 (the first on a tie)."""
    scores = {t: math.log(p) - math.log(-math.log(reference_uniform(seed, position, t)))
              for t, p in enumerate(probs) if p > 0}
    return max(scores, key=lambda t: (scores[t], -t))


def params_tuple(params: SamplingParams) -> tuple[float, int, float]:
    return params.temperature, params.top_k, params.top_p


# ---- the processed distribution ----

def logit_rows(vocab: int) -> torch.Tensor:
    """Random rows, rows full of ties, and rows whose top-p boundary falls exactly on a cumulative sum."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(4, vocab, generator=g) * 2.0]
    rows.append(torch.randint(-3, 4, (4, vocab), generator=g).float())  # many ties, also at the k-th value
    exact = torch.full((2, vocab), -INF)
    exact[0, [3, 9, 17, 30]] = 0.0  # four tokens of probability exactly 1/4
    exact[1, :8] = torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.5, -1e4])
    rows.append(exact)
    return torch.cat(rows)


GRID = list(itertools.product(
    (1e-6, 0.25, 0.7, 1.0, 1.9),  # temperature (1e-6: greedy)
    (0, -1, 1, 2, 5, 39, 40, 47),  # top_k (vocab 40: off, off, one, ..., vocab - 1, vocab, more)
    (1.0, 0.95, 0.5, 0.3, 0.05),  # top_p (0.5 lands exactly on the boundary of the four 1/4 tokens)
))


def test_processed_probs_equals_reference():
    logits = logit_rows(40)
    rows = logits.tolist()
    for temperature, top_k, top_p in GRID:
        got = processed_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)).double()
        want = torch.tensor([reference_probs(row, temperature, top_k, top_p) for row in rows], dtype=torch.float64)
        where = f"temperature {temperature}, top_k {top_k}, top_p {top_p}"
        assert torch.equal(got > 0, want > 0), where  # exactly the same support in every row
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=where)


def test_processed_probs_edge_cases():
    logits = logit_rows(40)
    # top_p 0.5 on four tokens of 1/4: the first two are kept (the second is the one that reaches 0.5)
    half = processed_probs(logits[8:9], SamplingParams(temperature=1.0, top_p=0.5))[0]
    assert half.nonzero().flatten().tolist() == [3, 9] and half[3] == half[9] == 0.5
    # top_k 1 with a tie at the top keeps both tied tokens
    tied = processed_probs(logits[9:10], SamplingParams(temperature=1.0, top_k=1))[0]
    assert tied.nonzero().flatten().tolist() == [0, 1]
    # top_k >= vocab and top_p 1.0 change nothing
    plain = torch.softmax(logits[:4] / 0.7, dim=-1)
    torch.testing.assert_close(processed_probs(logits[:4], SamplingParams(temperature=0.7, top_k=400)), plain)


@pytest.mark.parametrize("temperature", [1e-38, 1e-6, 9.9e-6])
def test_tiny_temperature_is_greedy_and_never_nan(temperature):
    logits = logit_rows(40)
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=5, seed=3)
    assert params.greedy and not SamplingParams(temperature=1e-5).greedy
    probs = processed_probs(logits, params)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(10))
    assert choose_tokens(logits, params, 3, 0) == logits.argmax(-1).tolist()


def test_non_finite_logits_fall_back_to_the_argmax():
    """An overflowed logit (+inf, as fp16 can produce) gives a one-hot at it, never NaN probabilities."""
    logits = logit_rows(40)[:4].clone()
    logits[1, 7] = INF
    params = SamplingParams(temperature=0.7, top_p=0.9)
    probs = processed_probs(logits, params)
    assert torch.isfinite(probs).all()
    assert probs[1].nonzero().flatten().tolist() == [7]
    torch.testing.assert_close(probs[0], processed_probs(logits[:1], params)[0])  # other rows untouched
    assert choose_tokens(logits, params, 9, 0)[1] == 7


def test_choose_tokens_is_the_position_keyed_gumbel_max():
    """Row i of a block is the Gumbel-max draw keyed by (seed, first_position + i, token) from the processed law."""
    logits = logit_rows(40)[:8]
    for (temperature, top_k, top_p), seed in itertools.product(GRID[::7], (0, 12345, 2**63 + 5)):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        got = choose_tokens(logits, params, seed, 17)
        want = [gumbel_max(reference_probs(row, temperature, top_k, top_p), seed, 17 + i)
                for i, row in enumerate(logits.tolist())]
        assert got == want, (temperature, top_k, top_p, seed)


def test_token_noise_is_the_documented_hash():
    """The noise computed in int64 tensors is bit for bit the plain-Python hash, for seeds with the top bit set and
    large positions too; and key / token hashes are splitmix64's outputs (seed 0's first two are published)."""
    assert splitmix64_finaliser(GOLDEN) == 0xE220A8397B1DCDAF  # splitmix64 seeded with 0: its first output
    assert splitmix64_finaliser(2 * GOLDEN % (1 << 64)) == 0x6E789E6AA1B965F4  # ... and its second
    seeds = [0, 1, 12345, 2**63 + 5, 2**64 - 1]
    positions = [0, 17, 2**20, 2**40 + 3, 7]
    signed = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds], dtype=torch.int64)
    got = token_uniforms(signed, torch.tensor(positions), 300)
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        for token in (0, 1, 2, 255, 299):
            assert got[row, token].item() == reference_uniform(seed, position, token), (seed, position, token)
    assert 0.0 < got.min().item() and got.max().item() < 1.0


def test_the_draw_follows_the_processed_law():
    """20,000 positions of one fixed 8-token distribution (a ninth token at -inf): the counts fit the law by
    Pearson's chi-square with 7 degrees of freedom below 24.32, its 0.999 quantile, and the -inf token never comes."""
    logits = torch.tensor([1.2, 0.4, 0.0, -0.3, -0.8, 0.9, -1.5, 0.1, -INF])
    probs = reference_probs(logits.tolist(), 1.0)
    n = 20_000
    tokens = choose_tokens(logits.expand(n, -1), SamplingParams(temperature=1.0), 2024, 100)
    counts = Counter(tokens)
    assert counts[8] == 0
    chi_square = sum((counts[t] - n * probs[t]) ** 2 / (n * probs[t]) for t in range(8))
    assert chi_square < 24.32, (chi_square, sorted(counts.items()))


def test_slices_of_rows_and_columns_draw_the_same_tokens(monkeypatch):
    """A big step's draw runs in slices (of columns on the CPU, of rows past a workspace bound on any device):
    every row still gets the token of one whole draw."""
    from dflash_core import sampling

    g = torch.Generator().manual_seed(9)
    probs = torch.softmax(torch.randn(12, 3000, generator=g), dim=-1)
    seeds = torch.randint(0, 2**62, (12,), generator=g)
    positions = torch.randint(0, 10**6, (12,), generator=g)
    whole = (probs / token_uniforms(seeds, positions, 3000).log()).argmin(dim=-1)
    assert torch.equal(sampling.race_choice(probs, seeds, positions), whole)  # column slices of 5,461
    monkeypatch.setattr(sampling, "_DRAW_ELEMENTS", 5 * 3000)  # rows 5 at a time, too
    assert torch.equal(sampling.race_choice(probs, seeds, positions), whole)


def test_draws_are_stable_under_float_noise_in_the_logits():
    """Logits that differ by a relative 1e-6 (as another forward computes them) change almost no draw: a Gumbel-max
    draw flips only when its two best perturbed scores are that close. 2,000 positions of flat logits over 4,096
    tokens at temperature 1, nudged by 1e-6 and by 1e-4: at most 2 flips each (measured: 0 and 0). The inverse-CDF
    draw this replaced flipped 1 and 14 of these draws (2 and 65 of 10,000 over five seeds): it flips whenever its
    uniform falls near any of the V cumulative boundaries."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2000, 4096, generator=g)
    noise = torch.randn(2000, 4096, generator=g)
    params = SamplingParams(temperature=1.0)
    drawn = choose_tokens(logits, params, 77, 0)
    for relative in (1e-6, 1e-4):
        nudged = logits * (1.0 + relative * noise)
        assert not torch.equal(logits, nudged)
        flips = sum(a != b for a, b in zip(drawn, choose_tokens(nudged, params, 77, 0)))
        assert flips <= 2, (relative, flips)


# ---- seeded speculative decoding == the reference's plain decoding ----

@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return make_target(None, "qwen3")


@torch.inference_mode()
def reference_decode(model: torch.nn.Module, prompt: list[int], params: SamplingParams, seed: int, n: int) -> list[int]:
    """Plain decoding: a full forward per token, the reference law, the draw keyed by the token's position."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].tolist()
        seq.append(gumbel_max(reference_probs(logits, *params_tuple(params)), seed, len(seq)))
    return seq[len(prompt):]


CASES = [
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=0.6, top_p=0.5),
]
PROMPTS = [[5], [20, 21, 22], list(range(30, 70))]
N_TOKENS = 24
BLOCK = 8
PATTERN = (7, 2, 0, 5, 7, 1, 3)


@pytest.fixture(scope="module")
def sampled_references(tiny_model) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    return {(c, tuple(p)): reference_decode(tiny_model, p, CASES[c], 1000 + c, N_TOKENS)
            for c in range(len(CASES)) for p in PROMPTS}


def make_backend(model: torch.nn.Module, backend: str) -> HFTarget | NativeTarget:
    return HFTarget(model) if backend == "hf" else NativeTarget(model, None, max_slots=4, max_len=128)


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_seeded_speculation_equals_reference_plain_decoding(tiny_model, sampled_references, backend, case):
    """Drafts right for part of each block: the sampled output and every acceptance length are as predicted."""
    refs = {p: ref for (c, p), ref in sampled_references.items() if c == case}
    target = make_backend(tiny_model, backend)
    engine = Engine(target, ScriptedDrafter(refs, BLOCK, target.vocab_size, pattern=PATTERN), eos_token_ids=[])
    params = CASES[case]
    ids = {engine.add_request(list(p), SamplingParams(**{**params.__dict__, "max_tokens": N_TOKENS,
                                                         "seed": 1000 + case})): p for p in refs}
    outs = run_all(engine)
    expected_lengths = predicted_acceptance(N_TOKENS, BLOCK, PATTERN)
    for rid, p in ids.items():
        assert tokens(outs[rid]) == refs[p]
        assert [s.acceptance_length for s in outs[rid] if not s.is_prefill] == expected_lengths


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_seeded_speculation_with_argmax_draft_equals_reference(tiny_model, sampled_references, backend):
    """A draft proposing the target's argmax, rejected whenever the sampled token differs: output still exact."""
    target = make_backend(tiny_model, backend)
    engine = Engine(target, OracleDrafter(tiny_model, 4), eos_token_ids=[])
    ids = {}
    for case in (0, 2):
        for p in PROMPTS[1:]:
            params = SamplingParams(**{**CASES[case].__dict__, "max_tokens": N_TOKENS, "seed": 1000 + case})
            ids[engine.add_request(list(p), params)] = (case, tuple(p))
    outs = run_all(engine)
    for rid, key in ids.items():
        assert tokens(outs[rid]) == sampled_references[key]
    accepted = [engine.stats(rid).num_accepted_tokens for rid in ids]
    drafted = [engine.stats(rid).num_draft_tokens for rid in ids]
    assert 0 < sum(accepted) < sum(drafted)  # argmax drafts were both accepted and rejected


# ---- the accepted tokens follow the exact target law ----

DEPTH = 5  # tokens per request: the prefill's, then 4 from verify steps
CHI_PARAMS = dict(temperature=1.0, top_k=3)  # three candidates per position: the exact law is a small tree
CHI_PROMPT = [11, 12, 13]
CHI_SAMPLES = 800


@torch.inference_mode()
def exact_tree(model: torch.nn.Module) -> dict[tuple[int, ...], tuple[list[int], list[float], int]]:
    """For every reachable prefix of generated tokens: the support, its probabilities, and the raw argmax."""
    tree, level = {}, [()]
    for _ in range(DEPTH):
        logits = model(torch.tensor([CHI_PROMPT + list(node) for node in level]), use_cache=False).logits[:, -1]
        nxt = []
        for node, row in zip(level, logits.tolist()):
            probs = reference_probs(row, CHI_PARAMS["temperature"], CHI_PARAMS["top_k"])
            support = [t for t, p in enumerate(probs) if p > 0]
            tree[node] = (support, [probs[t] for t in support], max(range(len(row)), key=row.__getitem__))
            nxt += [node + (t,) for t in support]
        level = nxt
    return tree


class TreeArgmaxDrafter(OracleDrafter):
    """Proposes the target's argmax continuation (read from the exact tree) for every request in one call."""

    def __init__(self, tree: dict, block_size: int) -> None:
        self.tree = tree
        self.block_size = block_size

    def propose(self, state: dict, last_token: int, position: int, n: int) -> list[int]:
        if state["last"] is not None:
            state["seq"] = (state["seq"] + [state["last"]] + state["proposals"])[:position]
        state["last"] = last_token
        node = tuple(state["seq"][len(CHI_PROMPT):] + [last_token])
        proposals = []
        for _ in range(n):
            best = self.tree[node][2] if node in self.tree else 0
            proposals.append(best)
            node += (best,)
        state["proposals"] = proposals
        return proposals


def leaf_law(tree: dict) -> dict[tuple[int, ...], float]:
    """The exact probability of every DEPTH-token output of the tree (`exact_tree`)."""
    leaves: dict[tuple[int, ...], float] = {}

    def walk(node: tuple[int, ...], prob: float) -> None:
        if len(node) == DEPTH:
            leaves[node] = prob
            return
        for t, p in zip(*tree[node][:2]):
            walk(node + (t,), prob * p)

    walk((), 1.0)
    return leaves


def p_value(observed: Counter, expected: dict, n: int) -> float:
    """Pearson's chi-square p-value of n samples' counts against a law (outcomes expected < 5 times pooled)."""
    from scipy.stats import chisquare

    big = [k for k, e in expected.items() if e * n >= 5]
    obs = [observed[k] for k in big] + [n - sum(observed[k] for k in big)]
    exp = [expected[k] for k in big] + [1.0 - sum(expected[k] for k in big)]
    if exp[-1] * n < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    total = sum(exp)
    return float(chisquare(obs, [e * n / total for e in exp]).pvalue)


def law_p_values(samples: Counter, leaves: dict[tuple[int, ...], float], n: int) -> dict[str, float]:
    """p-values of n sampled outputs against the exact law: the joint one, and each generated position's marginal."""
    p_values = {"joint": p_value(samples, leaves, n)}
    for j in range(1, DEPTH):
        observed, expected = Counter(), Counter()
        for seq, count in samples.items():
            observed[seq[j]] += count
        for seq, prob in leaves.items():
            expected[seq[j]] += prob
        p_values[f"position {j}"] = p_value(observed, expected, n)
    return p_values


def test_accepted_tokens_follow_the_exact_target_law(tiny_model, record_property):
    """Chi-square goodness of fit of the engine's 5-token outputs (distinct seeds) against the exact joint law,
    and of each verified position's marginal. With temperature 1 the sampled token often differs from the argmax
    draft, so an acceptance rule that lets an argmax draft through when it differs from the target's choice
    skews these laws."""
    tree = exact_tree(tiny_model)
    leaves = leaf_law(tree)
    target = NativeTarget(tiny_model, None, max_slots=CHI_SAMPLES, max_len=len(CHI_PROMPT) + 2 * DEPTH + 2)
    engine = Engine(target, TreeArgmaxDrafter(tree, DEPTH), eos_token_ids=[])
    ids = [engine.add_request(CHI_PROMPT, SamplingParams(max_tokens=DEPTH, seed=s, **CHI_PARAMS))
           for s in range(CHI_SAMPLES)]
    outs = run_all(engine)
    samples = Counter(tuple(tokens(outs[i])) for i in ids)
    st = [engine.stats(i) for i in ids]
    assert sum(s.num_accepted_tokens for s in st) > CHI_SAMPLES  # argmax drafts were accepted ...
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in st) > CHI_SAMPLES  # ... and rejected
    assert all(seq in leaves for seq in samples), "an output the target law gives probability 0"

    p_values = law_p_values(samples, leaves, CHI_SAMPLES)
    # how many verified tokens equal the argmax draft: the statistic a draft-favouring rule moves most

    def argmax_hits(seq: tuple[int, ...]) -> int:
        return sum(seq[j] == tree[seq[:j]][2] for j in range(1, DEPTH))

    observed, expected = Counter(), Counter()
    for seq, count in samples.items():
        observed[argmax_hits(seq)] += count
    for seq, prob in leaves.items():
        expected[argmax_hits(seq)] += prob
    p_values["argmax hits"] = p_value(observed, expected, CHI_SAMPLES)
    record_property("p_values", p_values)
    assert min(p_values.values()) > 1e-3, p_values
