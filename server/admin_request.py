"""The body of ``POST /v1/admin/draft`` (``AdminDraftRequest``): the draft folder to serve from now on."""

from __future__ import annotations

from pydantic import Field

from server.field_policy import Strict


class AdminDraftRequest(Strict):
    """``POST /v1/admin/draft``: a draft folder on the server's machine (config.json + weights), checked against the
    target as at start-up before it replaces the serving draft."""

    path: str = Field(min_length=1, max_length=4096)
