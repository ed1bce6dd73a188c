"""Paged KV cache bookkeeping: the engine's block pool (ids, refs, prefix cache) and its stats."""

from dflash_core.kv.pool import BlockPool, KVStats, NoFreeBlocksError, blocks_for

__all__ = ["BlockPool", "KVStats", "NoFreeBlocksError", "blocks_for"]
