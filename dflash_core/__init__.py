"""dflash_core: the DFlash speculative-decoding engine (no HTTP)."""

__version__ = "0.1.0"
