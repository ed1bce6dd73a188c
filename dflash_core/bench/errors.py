"""The failures `dflash-bench` reports to the user, each with its exit code."""

from __future__ import annotations


class BenchError(RuntimeError):
    """A failure with a message for the user and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class IdentityError(BenchError):
    """Greedy DFlash output differs from plain decoding."""

    def __init__(self, index: int, position: int, plain: list[int], dflash: list[int]) -> None:
        a = plain[position] if position < len(plain) else "end of output"
        b = dflash[position] if position < len(dflash) else "end of output"
        super().__init__(
            f"greedy DFlash output differs from plain decoding: prompt {index}, first difference at output "
            f"position {position} (plain: {a}, DFlash: {b}; lengths {len(plain)} / {len(dflash)})",
            code=3,
        )
        self.index, self.position = index, position
