"""How much to speculate: the verify width of every request, step by step, from measured costs.

A verify row of width w checks w - 1 draft tokens plus the target's own next token. Wider rows commit more tokens
when the draft is right and cost more target compute always; under load the cost dominates. The policy:

1. **Which requests draft this step** (`WidthPolicy.drafting`). Each request keeps an average of the tokens its
   speculative steps committed. Requests are ranked by it and the drafting set is the top-k whose predicted
   tokens per second (from the measured step costs) is highest; the others take a plain step (width 1, no draft).
   A request left out this way is re-tried (`retry_after` steps later), since its text may turn predictable, but
   only where drafting would pay if it had (committing half a block a step): where a step's costs alone rule
   drafting out (a busy batch on a CPU), nothing is re-tried.
2. **Where to cut the proposals** (`WidthPolicy.widths`). The draft's probability of each proposed token gives
   the running product q_k, roughly the chance that the first k + 1 proposals are all accepted, so a row of width
   w is expected to commit 1 + q_0 + ... + q_{w-2} tokens (scaled by a calibration factor: accepted over expected
   on recent steps). Widths come from a fixed set (1, 2, 4, 8, 16 and, for bigger blocks, the block size) so that
   compiled or graph-captured shapes stay few, and a step's verify tokens stay within its budget (shared by all
   requests, so widths shrink as concurrency grows). A runner that runs each row's own tokens (the eager native
   backend: ragged rows) gives every row its own width, grown greedily while the step's predicted tokens per
   measured second rise; a runner that pads rows to the widest (the compiled static step, the hybrids) gives the
   step one width W (`verify_width`), cut where the rows' confidences together stop paying.

3. **Chain or tree** (`WidthPolicy.tree_sizes`, runners that verify trees: `dflash_core.tree`). A request may
   verify the top-n prefixes of its draft's candidates as a tree instead of its chain: n nodes are expected to
   commit the sum of their path probabilities (calibrated on recent tree steps). `--speculation tree` verifies
   trees of `tree_budget` nodes every step; the adaptive policy gives a row the tree size (or the chain) whose
   predicted tokens per second for the step is highest.

Cutting a proposal changes only how many tokens a step may accept, never which tokens are committed: every
committed token is still the target's own choice.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
MIN_SAMPLES = 3  # forwards measured before the costs decide anything (until then: full blocks)
RETRY_AFTER = 4  # plain steps before a request left out of drafting is re-tried (doubling while it does not pay)
POLICIES = ("adaptive", "fixed", "tree")
TREE_BUDGETS = (8, 16, 32, 64, 128)  # tree sizes (draft nodes) the adaptive policy weighs, up to its budget


def width_set(block_size: int) -> tuple[int, ...]:
    """The verify widths a block size allows: the fixed set up to it, and the block size itself."""
    return tuple(sorted({w for w in WIDTHS if w < block_size} | {max(1, block_size)}))


def expected_accepted(confidence: Sequence[float]) -> list[float]:
    """Expected accepted tokens of a proposal cut after each of its tokens: the running products of the draft's
    probabilities, summed (the chance that the first k are all right, summed over k)."""
    out, q, total = [], 1.0, 0.0
    for c in confidence:
        q *= max(0.0, min(1.0, float(c)))
        total += q
        out.append(total)
    return out


def round_width(width: int, allowed: Sequence[int]) -> int:
    """The largest allowed width <= `width` (1 at least)."""
    return max((w for w in allowed if w <= width), default=1)


class LinearCost:
    """Seconds of a forward for a number of tokens, from measurements.

    Two views of the same samples: a table of the median of the latest samples per power-of-two token bucket (a
    forward's cost is flat while launches dominate, then grows with the tokens, which a line fits badly; the
    median ignores outliers such as a first, cold forward), and a least-squares
    line a + b x tokens over the latest samples for token counts no step has measured yet. Until it has samples
    at two token counts the line's slope is 0 (every token free), which makes the policy speculate fully: the
    behaviour of a fixed block.
    """

    def __init__(self, window: int = 128, per_bucket: int = 9) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        # running sums over `samples` (tokens, seconds, tokens^2, tokens x seconds): the line is fitted after every
        # forward and read dozens of times a step; tokens are ints, so the spread of tokens is exact
        self._sums = [0, 0.0, 0, 0.0]
        self._adds = 0
        self.per_bucket = per_bucket
        self._recent: dict[int, deque[float]] = {}  # bucket (a power of two) -> its latest samples
        self.table: dict[int, float] = {}  # bucket -> the median of its latest samples
        self._fit: tuple[float, float] | None = None

    @staticmethod
    def bucket(tokens: float) -> int:
        """The power of two nearest above `tokens` (1 at least)."""
        return 1 << max(0, math.ceil(math.log2(max(tokens, 1.0))))

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0 and math.isfinite(seconds):
            if self.samples and len(self.samples) == self.samples.maxlen:  # the oldest leaves the window
                self._count(*self.samples[0], -1)
            sample = (int(tokens), float(seconds))
            self.samples.append(sample)
            self._count(*sample, 1)
            self._adds += 1
            if self._adds % (self.samples.maxlen or 1) == 0:  # the float sums afresh now and then: no drift
                self._sums = [0, 0.0, 0, 0.0]
                for t, s in self.samples:
                    self._count(t, s, 1)
            self._fit = None
            recent = self._recent.setdefault(self.bucket(tokens), deque(maxlen=self.per_bucket))
            recent.append(float(seconds))
            self.table[self.bucket(tokens)] = statistics.median(recent)

    def _count(self, tokens: int, seconds: float, sign: int) -> None:
        sums = self._sums
        sums[0] += sign * tokens
        sums[1] += sign * seconds
        sums[2] += sign * tokens * tokens
        sums[3] += sign * tokens * seconds

    @property
    def ready(self) -> bool:
        """Enough samples to decide on (the first forwards of a process are often slow: cold caches)."""
        return len(self.samples) >= MIN_SAMPLES

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope) of the fitted line, in seconds and seconds per token; both >= 0."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        if not self.samples:
            return 0.0, 0.0
        n = len(self.samples)
        st, ss, stt, sts = self._sums
        mx, my = st / n, ss / n
        nsxx = n * stt - st * st  # n x the spread of tokens: exact in ints
        if nsxx <= 0:
            return my, 0.0
        slope = max(0.0, (n * sts - st * ss) / nsxx)
        intercept = my - slope * mx
        if intercept < 0:  # a line through the origin then: cost proportional to tokens
            intercept, slope = 0.0, ss / st
        return intercept, slope

    def __call__(self, tokens: float) -> float:
        """Predicted seconds: between the two measured buckets around `tokens`, linearly; the bucket above when
        only it is measured; else the line."""
        hi = self.bucket(tokens)
        measured = self.table.get(hi)
        if measured is None:
            a, b = self.coefficients()
            return a + b * max(tokens, 0.0)
        below = self.table.get(hi // 2) if hi > 1 else None
        if below is None or tokens >= hi:
            return measured
        frac = (tokens - hi // 2) / (hi - hi // 2)
        return below + max(0.0, measured - below) * frac


@dataclass
class StepCosts:
    """Measured costs of the forwards of a step: the target's (prefill, chain verify, plain), the target's that
    verify trees, and the draft's. A tree forward has its own table: it may run another path than a chain's of
    as many tokens (on a CPU PyTorch's forward with a tree mask, against the fused step's one C call: 2-3x the
    time), and one table for both would price each with the other's costs."""

    target: LinearCost = field(default_factory=LinearCost)
    draft: LinearCost = field(default_factory=LinearCost)
    tree: LinearCost = field(default_factory=LinearCost)

    def plain_step(self, num_requests: int) -> float:
        """Seconds a plain decoding step of `num_requests` requests would take (one token each)."""
        return self.target(num_requests)

    def verify_table(self, trees: bool) -> LinearCost:
        """The table of verify forwards with trees among their rows (`tree`), or of chains only (`target`)."""
        return self.tree if trees else self.target

    def verify(self, tokens: int, trees: bool) -> float:
        """Seconds of a verify forward of `tokens` tokens, with trees among its rows or chains only."""
        return self.verify_table(trees)(tokens)


@dataclass
class SpecState:
    """A request's speculation history, kept by the policy."""

    mean_committed: float  # tokens a speculative step committed, running average (optimistic at first)
    plain_streak: int = 0  # plain steps since it last drafted
    retry_after: int = 4  # RETRY_AFTER, doubled by every re-try that the policy would not have chosen


class WidthPolicy:
    """Chooses who drafts, how many tokens the draft proposes, and the step's verify width (module docstring).

    With `padded` rows (the runner pads a batch to its widest row) one width W serves the whole step; otherwise
    each row has its own. `policy="fixed"` drafts every request at the full block (the paper's and vLLM's fixed
    `num_speculative_tokens`); `"adaptive"` uses the measured costs. A step's verify budget (from the scheduler)
    bounds its verify tokens either way.
    """

    def __init__(self, block_size: int, policy: str = "adaptive", ema: float = 0.15,
                 max_retry_after: int = 128, padded: bool = True, tree_budget: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"speculation policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.block_size = block_size
        self.policy = policy
        self.padded = padded  # the target pads a batch's rows to the widest (else it runs their tokens ragged)
        self.allowed = width_set(block_size)
        self.costs = StepCosts()
        self.ema = ema
        self.max_retry_after = max_retry_after
        self.mean_committed = (block_size + 1) / 2  # over all requests' speculative steps (optimistic at first)
        # accepted draft tokens over the draft's own expectation (the running products of its probabilities
        # summed): drafts are not calibrated, the demo's accepts about 1.2x what its probabilities promise
        self.calibration = 1.0
        self._expected = self._accepted = 0.0
        self.tree_budget = tree_budget  # the most draft nodes of a tree (0: chains only)
        self.tree_calibration = 1.0  # the same ratio on tree steps
        self._tree_expected = self._tree_accepted = 0.0

    @property
    def adaptive(self) -> bool:
        return self.policy == "adaptive" and self.costs.target.ready and self.costs.draft.ready

    @property
    def uses_trees(self) -> bool:
        """Whether rows may verify trees: `--speculation tree`, or the adaptive policy with a tree budget."""
        return self.tree_budget > 0 and self.policy in ("tree", "adaptive")

    def fresh(self) -> WidthPolicy:
        """The same policy and measured step costs, with nothing learnt of the draft's acceptance (after the warm-up's
        made-up requests, or a new draft)."""
        policy = WidthPolicy(self.block_size, self.policy, self.ema, self.max_retry_after, self.padded,
                             self.tree_budget)
        policy.costs = self.costs
        return policy

    def new_state(self) -> SpecState:
        """A new request starts from what recent requests committed per speculative step."""
        return SpecState(mean_committed=self.mean_committed)

    def _round_up(self, width: float) -> int:
        return min((w for w in self.allowed if w >= width), default=self.allowed[-1])

    # ---- 1. who drafts, and how far ----
    def drafting(self, states: Sequence[SpecState], room: Sequence[int]) -> list[int]:
        """Draft tokens to ask for, per request (0: a plain step). `room[i]` is the most request i may draft
        (B - 1, fewer near its max_tokens)."""
        if not self.adaptive:
            return list(room)
        n = len(states)
        order = sorted((i for i in range(n) if room[i] > 0), key=lambda i: -states[i].mean_committed)
        if not order:
            return [0] * n
        # the draft proposes about twice what the best request has been committing (a width in the set)
        width = self._round_up(min(2 * states[order[0]].mean_committed, self.block_size))
        def rate(k: int, tokens: float) -> float:  # predicted tokens per second of a step where k requests draft
            verified = n * width if self.padded else n + k * (width - 1)
            return tokens / max(self.costs.target(verified) + self.costs.draft(k * width), 1e-9)

        best_k, best_rate = 0, n / max(self.costs.plain_step(n), 1e-9)
        tokens = float(n)
        for k, i in enumerate(order, start=1):
            tokens += states[i].mean_committed - 1.0
            if rate(k, tokens) > best_rate:
                best_k, best_rate = k, rate(k, tokens)
        chosen = set(order[:best_k])
        tokens = n + sum(states[i].mean_committed - 1.0 for i in chosen)
        for i in chosen:  # drafting on merit: its next plain streak starts with a short re-try again
            states[i].retry_after = RETRY_AFTER
        for i in order[best_k:]:  # left out: re-try one that has waited long enough, on a step that drafts anyway
            # (with other requests, a draft forward for re-tries alone costs its whole launch overhead for little:
            # wait 4x longer; a lone request's re-try is cheap next to what a wrong plain streak loses)
            wait = states[i].retry_after * (1 if chosen or n == 1 else 4)
            if states[i].plain_streak < wait:
                continue
            # A re-try finds out whether its text has turned predictable: only worth its cost if drafting would pay
            # were it so (committing half a block, or its own average if more, at most what its row can: a hope
            # that nothing learnt lowers, so a draft that did badly for a while is still re-tried). Where the step's
            # costs alone rule drafting out (a CPU's verify costs grow with every token, and a busy batch's plain
            # step is cheap per token), no acceptance could, and re-tries would only slow every request down.
            # (the hope falls along `order`, near max_tokens aside: once one does not pay, the rest wait)
            can = min(room[i], width - 1) + 1  # the most its row can commit this step
            hoped = tokens + min(max((self.block_size + 1) / 2, states[i].mean_committed), can) - 1.0
            if rate(len(chosen) + 1, hoped) < best_rate:
                break
            chosen.add(i)
            tokens, best_rate = hoped, rate(len(chosen), hoped)
        return [min(room[i], width - 1) if i in chosen else 0 for i in range(n)]

    # ---- 2. how wide ----
    def widths(self, confidences: Sequence[Sequence[float]], budget: int | None = None) -> list[int]:
        """Draft tokens each row verifies (a prefix of its proposal; 0 for a plain row). Padded rows share the
        step's width (`verify_width`); ragged rows each get the width, from the set, where the step's predicted
        tokens per second peak, within the budget on their verify tokens."""
        if not any(confidences):  # a plain step: nobody drafted
            return [0] * len(confidences)
        if self.padded or not self.adaptive:
            w = self.verify_width(confidences, budget)
            return [min(w - 1, len(c)) for c in confidences]
        n = len(confidences)
        gains = self._gains(confidences)
        steps = [sorted({w - 1 for w in self.allowed if w - 1 <= len(c)} | {len(c)}) for c in confidences]
        keep = [0] * n
        tokens, verified = float(n), n
        spent = self.costs.draft(0) if any(confidences) else 0.0
        limit = budget if budget is not None else math.inf
        while True:  # greedy: the upgrade (a row to its next width) that raises the predicted rate most
            rate = tokens / max(spent + self.costs.target(verified), 1e-9)
            best: tuple[float, int, int] | None = None
            for r in range(n):
                nxt = next((k for k in steps[r] if k > keep[r]), None)
                if nxt is None or verified + nxt - keep[r] > limit:
                    continue
                t = tokens + gains[r][nxt] - gains[r][keep[r]]
                new_rate = t / max(spent + self.costs.target(verified + nxt - keep[r]), 1e-9)
                if new_rate > rate and (best is None or new_rate > best[0]):
                    best = (new_rate, r, nxt)
            if best is None:
                return keep
            _, r, nxt = best
            tokens += gains[r][nxt] - gains[r][keep[r]]
            verified += nxt - keep[r]
            keep[r] = nxt

    def verify_width(self, confidences: Sequence[Sequence[float]], budget: int | None = None) -> int:
        """The step's verify width W for rows whose proposals carry these draft probabilities ([] for a plain
        row): each row then verifies min(W - 1, its proposal) draft tokens. `budget` bounds rows x W."""
        rows = len(confidences)
        longest = max((len(c) for c in confidences), default=0)
        if self.adaptive:  # the set, and the whole proposals (shorter than a block near max_tokens)
            candidates = sorted({w for w in self.allowed if w <= longest + 1} | {longest + 1})
        else:
            candidates = [longest + 1]  # the whole proposals: the block size, or less near max_tokens
        if budget is not None and rows * candidates[-1] > budget:
            fits = [w for w in self.allowed if rows * w <= budget and w <= longest + 1]
            candidates = fits[-1:] or [1]
        if len(candidates) == 1:
            return candidates[0]
        gains = self._gains(confidences)
        draft_spent = self.costs.draft(0) if longest else 0.0
        best_w, best_rate = 1, -1.0
        for w in candidates:
            tokens = sum(1.0 + g[min(w - 1, len(g) - 1)] for g in gains)
            rate = tokens / max(self.costs.target(rows * w) + draft_spent, 1e-9)
            if rate > best_rate:
                best_w, best_rate = w, rate
        return best_w

    def _gains(self, confidences: Sequence[Sequence[float]]) -> list[list[float]]:
        """Per row, the expected accepted tokens when it verifies k = 0, 1, ... draft tokens: the running products
        of the draft's probabilities summed, calibrated, at most k."""
        return [[0.0] + [min(float(k), self.calibration * g) for k, g in enumerate(expected_accepted(c), start=1)]
                for c in confidences]

    # ---- 3. chain or tree ----
    def tree_sizes(self, chain_gains: Sequence[float], chain_tokens: Sequence[int],
                   node_probs: Sequence[Sequence[float] | None], budget: int | None = None) -> list[int]:
        """Per row, the draft nodes of the tree it verifies (0: its chain). Row r's chain verifies chain_tokens[r]
        tokens expecting chain_gains[r] accepted; node_probs[r] are the path probabilities of its candidate tree's
        nodes, best first (None: the row cannot verify a tree), so a tree of its first n nodes expects their sum.
        `--speculation tree`: every row that can, `tree_budget` nodes (within the step's budget). Adaptive: each
        row in turn takes the size, from `TREE_BUDGETS`, or the chain, with the best predicted tokens per second."""
        n = len(chain_tokens)
        sizes = [0] * n
        if not self.uses_trees or (self.policy == "adaptive" and not self.adaptive):
            return sizes
        limit = budget if budget is not None else math.inf
        verified, tokens = sum(chain_tokens), float(n) + sum(chain_gains)
        spent = self.costs.draft(0)
        trees = False  # a row of the step verifies a tree: its forward is a tree forward (`StepCosts.tree`)
        for r, probs in enumerate(node_probs):
            if not probs:
                continue
            options = [k for k in TREE_BUDGETS if k <= min(self.tree_budget, len(probs))] or [len(probs)]
            if self.policy == "tree":
                options = [min(self.tree_budget, len(probs))]
            best, best_gain = 0, 0.0
            best_rate = -1.0 if self.policy == "tree" else tokens / max(spent + self.costs.verify(verified, trees),
                                                                            1e-9)
            for k in options:
                grown = verified - chain_tokens[r] + 1 + k
                if grown > limit:
                    continue
                gain = min(float(k), self.tree_calibration * sum(probs[:k]))
                rate = (tokens - chain_gains[r] + gain) / max(spent + self.costs.tree(grown), 1e-9)
                if rate > best_rate:
                    best, best_gain, best_rate = k, gain, rate
            if best:
                verified += 1 + best - chain_tokens[r]
                tokens += best_gain - chain_gains[r]
                sizes[r], trees = best, True
        return sizes

    def expected_chain(self, confidence: Sequence[float]) -> float:
        """Accepted tokens expected of a chain verifying these draft probabilities, calibrated."""
        return self._gains([confidence])[0][-1] if confidence else 0.0

    def calibrate_tree(self, expected: float, accepted: int) -> None:
        """Record a verified tree (the sum of its nodes' path probabilities) and its accepted nodes."""
        decay = 0.98
        self._tree_expected = decay * self._tree_expected + expected
        self._tree_accepted = decay * self._tree_accepted + accepted
        if self._tree_expected > 1.0:
            self.tree_calibration = min(4.0, max(0.25, self._tree_accepted / self._tree_expected))

    # ---- after the step ----
    def calibrate(self, verified_confidence: Sequence[float], accepted: int) -> None:
        """Record a verified proposal (the draft's probabilities of the tokens verified) and how many of its
        tokens were accepted; the calibration factor is their ratio over recent steps."""
        if not verified_confidence:
            return
        expected = expected_accepted(verified_confidence)[-1]
        decay = 0.98  # about the last 50 proposals
        self._expected = decay * self._expected + expected
        self._accepted = decay * self._accepted + accepted
        if self._expected > 1.0:
            self.calibration = min(4.0, max(0.25, self._accepted / self._expected))

    def observe(self, state: SpecState, drafted: bool, committed: int) -> None:
        """Record a request's step: committed tokens of a speculative step, or one more plain step."""
        if drafted:
            if state.plain_streak >= state.retry_after:  # a re-try: back off further if it still does not pay
                state.retry_after = min(state.retry_after * 2, self.max_retry_after)
            state.plain_streak = 0
            state.mean_committed += self.ema * (committed - state.mean_committed)
            self.mean_committed += 0.05 * (committed - self.mean_committed)
        else:
            state.plain_streak += 1
