"""``--api-key``: only ``Authorization: Bearer <the whole key>`` passes; a prefix, an extension or another scheme of
the key is refused with a 401 that names the scheme. The app in-process with a scripted engine (no model)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.fake_engine import FakeEngine, Script, demo_tokenizer
from tests.test_app_fake import MODEL
from tests.test_app_fake import make_app as fake_app

KEY = "sesame"
TIMEOUT_S = 30.0

REFUSED = [
    None,  # no header
    "",
    "Bearer",
    "Bearer ",
    "Bearer s",
    "Bearer sesam",  # every prefix of the key is refused ...
    "Bearer sesame2",  # ... and every extension of it
    "Bearer sesamesesame",
    "Bearer SESAME",
    "Bearer esame",
    "Basic sesame",
    "sesame",
    "Bearersesame",
    "Bearer sesame extra",
]
ACCEPTED = ["Bearer sesame", "bearer sesame", "BEARER sesame", "Bearer  sesame", "Bearer sesame "]


def make_app(api_key: str | None) -> Any:
    engine = FakeEngine(tokenizer=demo_tokenizer())
    engine.script("hi", Script(["ok"]))
    return fake_app(engine, api_key=api_key)


async def answers(app: Any, authorizations: list[str | None]) -> list[httpx.Response]:
    """POST one completion per Authorization value (None: no header); the responses, in order."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=TIMEOUT_S) as client:
            out = []
            for auth in authorizations:
                headers = {} if auth is None else {"Authorization": auth}
                out.append(await client.post("/v1/completions", json=body, headers=headers))
            out.append(await client.get("/health"))  # never behind the key
            return out


@pytest.mark.parametrize("auth", REFUSED, ids=repr)
def test_anything_but_the_whole_key_is_refused(auth: str | None) -> None:
    *responses, health = asyncio.run(asyncio.wait_for(answers(make_app(KEY), [auth]), TIMEOUT_S))
    (r,) = responses
    assert r.status_code == 401, (auth, r.status_code, r.text)
    assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert health.status_code == 200


def test_the_whole_key_passes_and_no_key_means_no_check() -> None:
    *responses, _ = asyncio.run(asyncio.wait_for(answers(make_app(KEY), ACCEPTED), TIMEOUT_S))
    for auth, r in zip(ACCEPTED, responses):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", (auth, r.text)
    *responses, _ = asyncio.run(asyncio.wait_for(answers(make_app(None), [None, "Bearer anything"]), TIMEOUT_S))
    assert [r.status_code for r in responses] == [200, 200]
