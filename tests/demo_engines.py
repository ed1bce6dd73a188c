"""The bundled demo pair loaded once per test process: the DFlash engine and a plain engine over the same target."""

from __future__ import annotations

from functools import lru_cache

from dflash_core.chat import encode_chat
from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.generate import RequestOutput, run_to_completion
from dflash_core.loading import LoadedModels, load_models
from dflash_core.sampling import SamplingParams

QUESTIONS = [
    "Convert 5 kilometers to meters.",
    "What is 12 times 7?",
    "How many centimeters are in 3 meters?",
]


@lru_cache(maxsize=1)
def demo() -> tuple[LoadedModels, Engine]:
    """(the demo pair with its draft, a plain engine on the same target, slots and grammar backend).

    The draft's engine speculates with the fixed width: the adaptive policy decides from wall time and takes plain
    steps on a loaded machine, and the exactness tests must see speculation run (`accepted_drafts`)."""
    models = load_models(EngineConfig(speculation="fixed"))
    eng = models.engine
    plain = Engine(eng.target, None, eos_token_ids=eng.eos_token_ids, kv=eng.kv, grammar=eng.grammar)
    return models, plain


def prompts() -> list[list[int]]:
    tok = demo()[0].tokenizer
    return [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]


def both(prompts_: list[list[int]], params: list[SamplingParams]) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """Each prompt's output with the draft and without (batched, as the server runs them)."""
    models, plain = demo()
    return run_to_completion(models.engine, prompts_, params), run_to_completion(plain, prompts_, params)


def accepted_drafts(outs: list[RequestOutput]) -> int:
    """Draft tokens the target accepted over these requests (speculation really ran)."""
    return sum(o.stats.num_accepted_tokens for o in outs)
