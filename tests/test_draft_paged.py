"""The batched drafter's paged context cache: rows live in the request's blocks (the target's block-id space).

Proposals do not depend on which blocks a request holds (a shuffled, non-contiguous table proposes as the slot's own
contiguous run, eagerly and through the padded static step, with and without a window), nor on who wrote its
leading rows (a state created with `cached=c` over another request's blocks proposes as that request), and equal
the per-request cache's. A window gathers only the blocks it covers.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash_core.compile import StaticShapes
from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft
from dflash_core.draft_cache import PagedDraftCache
from dflash_core.runners.base import DraftRequest
from dflash_core.runners.drafter import DFlashDrafter

KV_BLOCK = 8
NUM_BLOCKS = 80
MAX_LEN = 160  # 20 blocks a request
VOCAB, HIDDEN = 96, 32


@pytest.fixture(scope="module")
def draft() -> DFlashDraft:
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_target_layers=2, block_size=4,
                      mask_token_id=3, max_position_embeddings=1024, layer_types=["sliding_attention",
                                                                                  "full_attention"],
                      sliding_window=12)
    return DFlashDraft(cfg).eval()


@pytest.fixture(scope="module")
def target() -> SimpleNamespace:
    """What the drafter reads of a paged target runner: device, dtype, shared weights, its block-id space."""
    g = torch.Generator().manual_seed(1)
    return SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, kv_block_size=KV_BLOCK,
                           num_blocks=NUM_BLOCKS, embed_weight=torch.randn(VOCAB, HIDDEN, generator=g),
                           lm_head_weight=torch.randn(VOCAB, HIDDEN, generator=g))


def features(draft: DFlashDraft, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, len(draft.cfg.target_layer_ids) * HIDDEN, generator=g)


def features_3(draft: DFlashDraft) -> list[torch.Tensor]:
    return [features(draft, MAX_LEN, seed) for seed in (2, 3, 4)]


# (rows proposing, tokens each, context rows accepted after): prompts longer than a block go to the cache in a
# write of their own; 40 rows take a request past several blocks
STEPS = [(3, 3, 2), (2, 7, 3), (3, 3, 40), (3, 7, 1), (2, 3, 4), (3, 3, 2)]


def run(drafter: DFlashDrafter, tables: list[list[int] | None], feats: list[torch.Tensor]) -> list[Any]:
    """Three requests (prompts of 20, 9 and 31 positions) through STEPS; every proposal."""
    states = [drafter.new_state(i, [], tables[i]) if drafter.pages is not None else drafter.new_state(i, [])
              for i in range(3)]
    pos = [20, 9, 31]
    for st, f, p in zip(states, feats, pos):
        drafter.extend_context(st, f[:p])
    outs = []
    for step, (rows_n, n, accepted) in enumerate(STEPS):
        items = [DraftRequest(states[r], 5 + r + step, pos[r], n) for r in range(rows_n)]
        outs.append(drafter.propose_scored(items))
        for r in range(rows_n):
            drafter.extend_context(states[r], feats[r][pos[r] : pos[r] + accepted])
            pos[r] += accepted
    return outs


def assert_same(a: list[Any], b: list[Any], exact: bool = True) -> None:
    for sa, sb in zip(a, b, strict=True):
        for pa, pb in zip(sa, sb, strict=True):
            assert pa.tokens == pb.tokens
            if exact:  # the same rows in the same order: the same arithmetic
                assert pa.confidence == pb.confidence
            else:
                assert pa.confidence == pytest.approx(pb.confidence, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_shuffled_tables_propose_as_contiguous(draft, target, window, static) -> None:
    feats = features_3(draft)

    def drafter() -> DFlashDrafter:
        shapes = StaticShapes(batch_sizes=(2, 4), widths=(4, 8), compiled=False) if static else None
        return DFlashDrafter(draft, target, 8, max_slots=3, max_len=MAX_LEN, window=window, static=shapes)

    contiguous = drafter()
    assert tuple(contiguous.pages.k[0].shape) == (NUM_BLOCKS * KV_BLOCK, 2, 8)  # the target's block-id space
    assert contiguous.draft_bytes_per_block == 2 * 2 * KV_BLOCK * 2 * 8 * 4  # layers, K and V, rows, heads, d, fp32
    ref = run(contiguous, [None] * 3, feats)  # each slot's own run: blocks 1.., 21.., 41..
    ids = list(range(1, NUM_BLOCKS))
    random.Random(5).shuffle(ids)
    shuffled = drafter()
    assert_same(run(shuffled, [ids[:20], ids[20:40], ids[40:60]], feats), ref)
    if static:
        assert sum(shuffled.static.calls.values()) == len(STEPS)  # the padded step ran, over shuffled tables
    per_request = DFlashDrafter(draft, target, 8, window=window)  # DraftKVCache: the unpaged reference
    assert_same(run(per_request, [None] * 3, feats), ref, exact=False)


def test_window_gathers_only_its_blocks(draft, target, monkeypatch) -> None:
    tables: list[tuple[int, ...]] = []
    batch = PagedDraftCache.batch

    def recording(self, rows, table, base=None):  # noqa: ANN001, ANN202
        if table is not None:
            tables.append(tuple(table.shape))
        return batch(self, rows, table, base)

    monkeypatch.setattr(PagedDraftCache, "batch", recording)
    run(DFlashDrafter(draft, target, 8, max_slots=3, max_len=MAX_LEN, window=20), [None] * 3, features_3(draft))
    # positions past 70: a full gather would take 9+ blocks; the window's 20 positions lie in at most 4
    assert tables and max(m for _, m in tables) <= 20 // KV_BLOCK + 2


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
def test_cached_prefix_proposes_as_its_writer(draft, target, window) -> None:
    """Request A writes 45 positions of context; B shares A's first 2 blocks (16 positions, `cached=16`) and is fed
    only positions 16.. (held back: 29 rows are within a CPU's 4 blocks' worth, written by its first proposal);
    both then propose at the same positions with the same tokens, as does a fresh request fed everything."""
    drafter = DFlashDrafter(draft, target, 8, max_slots=3, max_len=MAX_LEN, window=window)
    f = features(draft, MAX_LEN, 6)
    a_blocks = list(range(1, 21))
    a = drafter.new_state(0, [], a_blocks)
    drafter.extend_context(a, f[:45])
    assert drafter.context_written(a) >= 40  # all but the last block's worth of rows: written at once
    drafter.propose_scored([DraftRequest(a, 7, 45, 3)])
    assert drafter.context_written(a) == 45
    b_blocks = a_blocks[:2] + list(range(60, 78))
    b = drafter.new_state(1, [], b_blocks, cached=16)
    assert drafter.context_written(b) == 16 and b.blocks is b_blocks  # the engine's list, grown in place
    drafter.extend_context(b, f[16:45])
    assert drafter.pending_limit == 4 * 8 and drafter.context_written(b) == 16
    fresh = DFlashDrafter(draft, target, 8, max_slots=3, max_len=MAX_LEN, window=window)
    c = fresh.new_state(2, [])
    fresh.extend_context(c, f[:45])
    pos = 45
    for step, accepted in enumerate((2, 30, 1)):
        pa, pb = drafter.propose_scored([DraftRequest(a, 9 + step, pos, 7), DraftRequest(b, 9 + step, pos, 7)])
        [pc] = fresh.propose_scored([DraftRequest(c, 9 + step, pos, 7)])
        assert pa.tokens == pb.tokens == pc.tokens
        assert pb.confidence == pytest.approx(pa.confidence, rel=1e-5) == pc.confidence  # batch shapes: rounding
        for st, d in ((a, drafter), (b, drafter), (c, fresh)):
            d.extend_context(st, f[pos : pos + accepted])
        pos += accepted


def test_new_state_checks(draft, target) -> None:
    drafter = DFlashDrafter(draft, target, 8, max_slots=3, max_len=MAX_LEN)
    assert drafter.new_state(2, []).blocks == list(range(41, 61))  # the slot's own run after the null block
    with pytest.raises(ValueError, match="slot 3"):
        drafter.new_state(3, [])
    with pytest.raises(ValueError, match="cached"):
        drafter.new_state(0, [], [1, 2], cached=17)
    small = SimpleNamespace(**{**vars(target), "num_blocks": 30})  # too few blocks for every slot's own run
    with pytest.raises(ValueError, match="block table"):
        DFlashDrafter(draft, small, 8, max_slots=3, max_len=MAX_LEN).new_state(2, [])
    st = drafter.new_state(0, [], [4])
    with pytest.raises(ValueError, match="blocks"):  # 40 rows: 32 go to the cache now, past the table's 1 block
        drafter.extend_context(st, features(draft, 40, 1))
    assert st.written == 0 and sum(f.shape[0] for f in st.pending) == 40  # nothing consumed
    assert drafter.prefix_cacheable
    unpaged = DFlashDrafter(draft, target, 8)
    assert not unpaged.prefix_cacheable and unpaged.context_written(unpaged.new_state(0, [], [1])) == 0
    with pytest.raises(ValueError, match="not paged"):
        unpaged.new_state(0, [], [1], cached=8)


def test_a_plain_streak_holds_context_rows_back_on_a_cpu_and_a_proposal_catches_up(draft, target, monkeypatch) -> None:
    """One committed position a step (plain steps): on a CPU the rows are written four blocks' worth at a time,
    not one block's; before a proposal (`catch_up`, which the engine calls untimed) what is held beyond a block is
    written, and the proposal is a drafter's that wrote every block at once (the limit on a GPU)."""
    writes: list[int] = []
    original = DFlashDrafter._write_context

    def counted(self, state, keep):  # noqa: ANN001, ANN202
        writes.append(id(self))
        return original(self, state, keep)

    monkeypatch.setattr(DFlashDrafter, "_write_context", counted)
    held = DFlashDrafter(draft, target, 8, max_slots=2, max_len=MAX_LEN)
    eager = DFlashDrafter(draft, target, 8, max_slots=2, max_len=MAX_LEN, pending_blocks=1)
    f = features(draft, MAX_LEN, 7)
    states = [d.new_state(0, []) for d in (held, eager)]
    for pos in range(80):
        for d, st in zip((held, eager), states):
            d.extend_context(st, f[pos : pos + 1])
    # past 32 rows (at 33 and 65) against past 8 (at 9, 17, .., 73), all but the last row or rows
    assert writes.count(id(held)) == 2 and writes.count(id(eager)) == 9
    assert (held.context_written(states[0]), states[0].pending_rows) == (64, 16)
    held.catch_up([states[0]])
    assert (held.context_written(states[0]), states[0].pending_rows) == (72, 8) == (eager.context_written(states[1]),
                                                                                  states[1].pending_rows)
    (ph,), (pe,) = (d.propose_scored([DraftRequest(st, 5, 80, 7)]) for d, st in zip((held, eager), states))
    assert ph.tokens == pe.tokens and ph.confidence == pytest.approx(pe.confidence, rel=1e-5)
