"""bf16 on CPU: the native runner's logits stay within bf16 tolerance of transformers' bf16 forward, and greedy
DFlash decoding (the bundled demo pair) agrees with greedy plain decoding on at least 99% of tokens (verify blocks
of 16 rows and plain steps of one row round differently in bf16, so exact equality is not promised there; fp32
tests demand it), and every DFlash output equals its plain run's or first leaves it at a near-tie of the target's top
two logits (the cross-shape policy of dflash_core/exactness.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_core.bench.prompts import HELDOUT_PATH, read_prompts
from dflash_core.chat import encode_chat, eos_token_ids
from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.exactness import compare_greedy, runner_logits
from dflash_core.loading import load_models
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams
from tests.helpers import make_target
from tests.test_engine import run_all, tokens

LAYER_IDS = [0, 2, 3]
PROMPTS, NEW_TOKENS = 24, 64


@pytest.fixture(scope="module")
def model():
    return make_target(None, arch="qwen3", seed=5).to(torch.bfloat16)


def test_native_bf16_logits_match_transformers(model):
    seq = torch.randint(4, 380, (56,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = HFTarget(model, LAYER_IDS)
    ref = hf.forward(seq, 0, hf.new_cache(), features=True)
    native = NativeTarget(model, LAYER_IDS, max_slots=2, max_len=128)
    slot = native.new_cache(1)
    prefill = native.forward(seq[:40], 0, slot, features=True)
    verify = native.forward(seq[40:], 40, slot, features=True)  # a 16-row verify block over the cache
    logits = torch.cat([prefill.logits, verify.logits])
    feats = torch.cat([prefill.features, verify.features]).float()
    scale = ref.logits.abs().max().item()
    # bf16 keeps 8 bits of mantissa: a few units in the last place of the largest logit
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=scale * 2**-6)
    torch.testing.assert_close(feats, ref.features.float(), rtol=2**-6, atol=2**-6 * ref.features.abs().max().item())
    agree = (logits.argmax(-1) == ref.logits.argmax(-1)).float().mean().item()
    assert agree >= 0.98, agree


def _plain_choices(target: NativeTarget, prompt: list[int], output: list[int], blocks: list[int]) -> list[int]:
    """Plain greedy decoding's choice at every position of `output`, teacher-forced on `prompt + output`: a prefill,
    then one-row steps, as the plain engine runs them (in `blocks`, which no request holds)."""
    cache = target.new_cache(0, blocks)
    choices = [int(target.forward(prompt, 0, cache, features=False, last_only=True).logits.argmax())]
    for k, token in enumerate(output[:-1]):
        choices.append(int(target.forward([token], len(prompt) + k, cache, features=False).logits[0].argmax()))
    return choices


def test_greedy_speculative_agrees_with_plain_in_bf16(record_property):
    """The bundled demo pair in bf16 on its held-out prompts. Two figures: per token (each DFlash token is what
    plain greedy decoding picks after the same prefix), which must reach 99%, and end to end (position by position
    against a plain run; one near-tie that rounds the other way changes every later token), which is reported. And
    the cross-shape policy (dflash_core/exactness.py): every DFlash output equals its plain run's or first differs
    where the target's top two logits are a near-tie."""
    # fixed speculation: every step verifies the full block (16 rows), the widest bf16 difference to a plain step
    models = load_models(EngineConfig(device="cpu", dtype="bfloat16", max_running_requests=4, speculation="fixed"))
    spec, tok = models.engine, models.tokenizer
    target = spec.target
    assert isinstance(target, NativeTarget) and target.dtype == torch.bfloat16
    plain = Engine(target, None, eos_token_ids=eos_token_ids(target.model, tok), kv=spec.kv)
    prompts = [encode_chat(tok, p.messages) for p in read_prompts(HELDOUT_PATH, "heldout")[:PROMPTS]]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    spec_ids = [spec.add_request(p, params) for p in prompts]
    spec_out = run_all(spec)
    plain_ids = [plain.add_request(p, params) for p in prompts]
    plain_out = run_all(plain)
    per_token = end_to_end = total = 0
    divergences = []
    for prompt, a, b in zip(prompts, plain_ids, spec_ids):
        x, y = tokens(plain_out[a]), tokens(spec_out[b])
        with spec.kv.borrow(len(prompt) + max(len(x), len(y)) + 1) as blocks:
            if (d := compare_greedy(x, y, runner_logits(target, prompt, blocks=blocks))) is not None:
                divergences.append(d)
            per_token += sum(i == j for i, j in zip(_plain_choices(target, prompt, y, blocks), y))
        end_to_end += sum(i == j for i, j in zip(x, y))
        total += max(len(x), len(y))
    accepted = sum(s.num_accepted_tokens for outs in spec_out.values() for s in outs)
    assert accepted > total / 4  # the trained draft: wide verify blocks, mostly accepted
    record_property("bf16_agreement_per_token", f"{per_token}/{total}")
    record_property("bf16_agreement_end_to_end", f"{end_to_end}/{total}")
    print(f"bf16 greedy, DFlash vs plain: per token {per_token}/{total} = {per_token / total:.2%}, "
          f"end to end {end_to_end}/{total} = {end_to_end / total:.2%}")
    for d in divergences:
        print(d)
    assert per_token / total >= 0.99, f"{per_token}/{total}"
    assert all(d.near_tie for d in divergences), "\n".join(str(d) for d in divergences if not d.near_tie)
