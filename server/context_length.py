"""The context-length rule: a prompt plus its completion budget must fit ``max_model_len`` (else a 400
``context_length_exceeded``), applied to a tokenized prompt (``resolve_max_tokens``) or, before tokenizing, to a
lower bound of its length (``check_min_prompt_tokens``)."""

from __future__ import annotations

from server.api_error import APIError


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    """The completion budget of a prompt of ``prompt_len`` tokens (400 ``context_length_exceeded`` if none)."""
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param=prompt_param)
    if requested is None:
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt is {prompt_len} tokens, leaving no room for a completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            f"for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def check_min_prompt_tokens(
    min_tokens: int, chars: int, requested: int | None, max_model_len: int, prompt_param: str
) -> None:
    """Refuse, before tokenizing, a prompt of at least ``min_tokens`` tokens that cannot fit the context.

    The same rule as ``resolve_max_tokens``, applied to a lower bound of the prompt's length.
    """
    fits = min_tokens < max_model_len if requested is None else min_tokens + requested <= max_model_len
    if fits:
        return
    raise APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {chars} "
        f"characters, which is at least {min_tokens} tokens"
        + (f", plus {requested} for the completion" if requested is not None else "")
        + ". Please reduce the prompt"
        + (" or max_tokens." if requested is not None else "."),
        param=prompt_param,
        code="context_length_exceeded",
    )
