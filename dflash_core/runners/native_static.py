"""The static (compiled) verify / plain step of the native target, over its paged KV cache.

A step is padded to a (batch, width) bucket (`StaticShapes`), and its keys to a key bucket (`kv_bucket`: a power
of two >= 256, at most the table a request can reach). Its only per-step inputs are four int64 arrays: token ids,
positions and the cache rows the tokens write [bb, nb], and the rows' block tables [bb, M] (M = key bucket /
kv_block). They go to the device in ONE copy (`HostToDevice`). Every dimension of them is dynamic, so one graph
serves every batch, width and key bucket (on CUDA a graph is still recorded per concrete shape; with the flex
kernel, one graph per width bucket: the mask's query length is a constant).

Padding: tokens beyond a row write rows of the null block 0 at position 0; rows beyond the batch have a table of
null blocks. No real query sees them: a query at position p sees its own row's positions 0 .. p only, all in its
own blocks. Warm-up runs padding only, so no request's rows change.

Attention kernel (`attention_kernel`, docs/attention.md): "sdpa" gathers each row's keys in the step; "flex" (CUDA by
default, `DFLASH_ATTENTION=flex|sdpa` overrides) reads the cache in place through a FlexAttention BlockMask that
`call` builds once per step from the table and positions already on the device, OUTSIDE the compiled function, and
passes in as a fifth argument (a BlockMask built inside the compiled graph, its mask_mod reading a tensor computed
there, has given wrong results). The mask is as wide as the cache, so a key bucket changes none of its shapes; its
batch dimension is marked dynamic like the other inputs'.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from dflash_core.attention import PagedAttention, attention_kernel, prepare
from dflash_core.compile import StaticShapes, kv_bucket, timed_warm_up
from dflash_core.runners.base import TargetOutput
from dflash_core.runners.native import Batch, Rope, Rows
from dflash_core.transfer import HostToDevice

if TYPE_CHECKING:
    from dflash_core.runners.native import NativeTarget

log = logging.getLogger("dflash.native")

Inputs = tuple[list[list[int]], list[list[int]], list[list[int]], list[list[int]]]


class StaticStep:
    """The padded step of a `NativeTarget`: compiled once, over every bucket; `run` the rows, `warm_up` it."""

    def __init__(self, runner: NativeTarget, shapes: StaticShapes) -> None:
        self.runner, self.shapes = runner, shapes
        for t in (*runner.k_cache, *runner.v_cache):
            torch._dynamo.mark_static_address(t)  # mutated in place by a CUDA graph
        self.kv_block = runner.kv_block_size
        self.cap = runner.table_len * self.kv_block  # the longest key bucket: a request's whole table
        self.h2d = HostToDevice(runner.device)
        # flex only in a compiled step (eager flex materialises the scores); eager padded steps gather + SDPA
        self.kernel = attention_kernel(runner.device) if shapes.compiled else "sdpa"
        prepare(runner.device, self.kernel)
        self.region: Any = None
        if shapes.by_layer(runner.device):
            # the step runs eagerly around ONE compiled layer region, which every layer calls with its own
            # weights and cache tensors: (layer, h, kc, vc, cos, sin, write, gather index, mask, flex BlockMask)
            dims = {1: (0, 1), 4: (0, 1), 5: (0, 1), 6: (0, 1), 7: (0, 1), 8: (0, 2, 3)}
            self.region = shapes.wrap(self._layer_region, runner.device, dynamic=dims)
            self.fn = self._forward
        else:
            # ids, pos, write rows [b, n], block tables [b, M] (+ the flex BlockMask, marked in `call`): one graph
            # over every batch, width and key bucket
            self.fn = shapes.wrap(self._forward, runner.device, dynamic={i: (0, 1) for i in range(4)})

    def table_width(self, kv_len: int) -> int:
        """Table entries of a step whose keys reach kv_len: its key bucket in blocks."""
        return -(-kv_bucket(kv_len, self.cap) // self.kv_block)

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, table: torch.Tensor, mask: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The padded step: logits [b, n, V] float32 and the features [b, n, F] (always computed when the runner has
        layer ids: one shape per bucket). `mask`: the flex BlockMask (kernel "flex"), else None (gather + SDPA)."""
        r = self.runner
        b, n = ids.shape
        if mask is not None:
            attention = PagedAttention.flex(mask, self.kv_block)
        else:
            attention = PagedAttention(table, pos, self.kv_block, r.kv_rows_total)
        batch = Batch((), b, n, None, pos, None, table, write, attention, static=True)
        h, feat = r._trunk(ids, batch, bool(r.layer_ids), self._run_region if self.region is not None else None)
        return r.lm_head(h).float(), feat

    def _run_region(self, li: int, layer: torch.nn.Module, h: torch.Tensor, batch: Batch, rope: Rope) -> torch.Tensor:
        """Layer `li` through the compiled layer region: its weights and cache tensors are the region's inputs."""
        a = batch.attention
        return self.region(self.runner.layer_module(li), h, *self.runner.layer_kv(li), *rope, batch.write, a.index,
                           a.mask, a.flex_mask)

    def _layer_region(
        self, layer: torch.nn.Module, h: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, write: torch.Tensor, index: torch.Tensor | None, mask: torch.Tensor | None, flex: Any,
    ) -> torch.Tensor:
        """One attention layer of the padded step (no layer index, no Python ints of the step's shape: one graph
        for every layer, batch, width and key bucket)."""
        b, n = h.shape[0], h.shape[1]
        kvb = self.kv_block
        attention = PagedAttention.flex(flex, kvb) if flex is not None else PagedAttention.gathered(index, mask, kvb)
        batch = Batch((), b, n, None, write, None, write, write, attention, static=True)  # only write is read
        return self.runner.attention_layer(layer, h, kc, vc, batch, (cos, sin))

    def padding(self, bb: int, nb: int, width: int) -> Inputs:
        """The inputs of a step of padding only: token 0 at position 0, written into the null block."""
        null_rows = [i % self.kv_block for i in range(nb)]
        return [[0] * nb for _ in range(bb)], [[0] * nb for _ in range(bb)], [list(null_rows) for _ in range(bb)], [
            [0] * width for _ in range(bb)]

    def run(self, rows: Rows, features: bool) -> list[TargetOutput] | None:
        """The rows (checked by the runner) through the static step, or None when they fit no bucket."""
        bb = self.shapes.batch_bucket(len(rows))
        nb = self.shapes.width_bucket(max(len(t) for t, _, _ in rows))
        if bb is None or nb is None:
            return None
        kvb = self.kv_block
        width = self.table_width(max(s + len(t) for t, s, _ in rows))
        ids, pos, write, table = self.padding(bb, nb, width)
        table[: len(rows)] = self.runner.tables(rows, width)
        for r, (tokens, start, cache) in enumerate(rows):
            m, blocks = len(tokens), cache.blocks
            ids[r][:m] = tokens
            pos[r][:m] = range(start, start + m)
            write[r][:m] = [blocks[p // kvb] * kvb + p % kvb for p in range(start, start + m)]
        logits, feat = self.call(bb, nb, (ids, pos, write, table))
        outs = []
        for r, (tokens, start, cache) in enumerate(rows):
            m = len(tokens)
            cache.length = start + m
            outs.append(TargetOutput(logits[r, :m], feat[r, :m] if features and feat is not None else None))
        return outs

    def call(self, bb: int, nb: int, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: its four inputs to the device in one copy, (flex) the step's BlockMask built from them on the
        device, outside the compiled function, then the step function."""
        self.shapes.calls[(bb, nb)] += 1
        ids, pos, write, table = self.h2d.send(*inputs)
        if self.kernel != "flex":
            return self.fn(ids, pos, write, table)
        return self.fn(ids, pos, write, table, self.block_mask(table, pos))

    def block_mask(self, table: torch.Tensor, pos: torch.Tensor) -> Any:
        """The step's flex BlockMask (a few small device ops, no host sync), its batch dimension (and the width, in
        the positions its mask_mod reads) marked dynamic, as the step's other inputs are."""
        from dflash_core.flex_attention import paged_block_mask

        mask = paged_block_mask(table, pos, self.kv_block, self.runner.kv_rows_total)
        if self.shapes.compiled:
            for t in block_mask_tensors(mask):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return mask

    def warm_up(self) -> float:
        """Compile the step, and on CUDA record the graph of every (batch, width, key bucket) shape
        (`StaticShapes.warm_up_plan`); padding only. Returns the seconds it took."""
        st = self.shapes
        plan = st.warm_up_plan(self.runner.device, self.cap, graph_per_width=self.kernel == "flex")
        runs = [
            (lambda bb=bb, nb=nb, kv=kv: self.call(bb, nb, self.padding(bb, nb, self.table_width(kv))))
            for bb in plan.batch_sizes for nb in plan.widths for kv in plan.keys
        ]
        seconds = timed_warm_up("native target", runs, log, plan.calls)
        st.calls.clear()
        return seconds


def block_mask_tensors(mask: Any) -> list[torch.Tensor]:
    """The tensors a BlockMask carries into a compiled function: its block counts and indices, and those its
    mask_mod closes over (every one has the step's batch as dimension 0)."""
    tensors = [t for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                           mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
               if isinstance(t, torch.Tensor)]
    for cell in mask.mask_mod.__closure__ or ():
        if isinstance(cell.cell_contents, torch.Tensor):
            tensors.append(cell.cell_contents)
    return tensors
