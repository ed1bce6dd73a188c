"""Penalties, logit_bias, min_p and min_tokens: vLLM's formulas, per verify row, and speculative == plain output."""

from __future__ import annotations

import pytest
import torch

from dflash_core.generate import run_to_completion
from dflash_core.grammar import StructuredOutput
from dflash_core.processors import build_processor
from dflash_core.sampling import SamplingParams, processed_probs
from tests.demo_engines import accepted_drafts, both, demo, prompts

V = 12


def vllm_reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams,
                   stop_ids: set[int]) -> list[float]:
    """One row, token by token, as vLLM's sampler writes it: min_tokens, logit_bias, then repetition, frequency and
    presence penalties."""
    out = list(logits)
    for t in range(len(out)):
        if t in stop_ids and len(output) < p.min_tokens:
            out[t] = float("-inf")
        out[t] += p.logit_bias.get(t, 0.0)
        if t in prompt or t in output:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * output.count(t)
        out[t] -= p.presence_penalty * (t in output)
    return out


ALL = SamplingParams(max_tokens=64, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6,
                     logit_bias={3: 5.0, 7: -100.0}, min_tokens=6)


def test_each_verify_row_equals_the_plain_row_at_its_position() -> None:
    """Row i of a block equals a one-row computation after output + draft[:i], and vLLM's formulas."""
    torch.manual_seed(0)
    prompt, output, draft = [1, 4, 4, 9], [5, 2, 5], [5, 11, 0, 2, 5]
    logits = torch.randn(len(draft) + 1, V) * 3
    stop_ids = {0, 2}
    block = build_processor(ALL, prompt, stop_ids, V).apply(logits.clone(), output, draft)
    one_row = build_processor(ALL, prompt, stop_ids, V)
    for i in range(len(draft) + 1):
        history = output + draft[:i]
        plain = one_row.apply(logits[i:i + 1].clone(), history, [])
        assert torch.equal(block[i:i + 1], plain), i
        ref = torch.tensor(vllm_reference(logits[i].tolist(), prompt, history, ALL, stop_ids))
        assert torch.allclose(block[i], ref, atol=1e-5), i
    # min_tokens 6: rows 0..2 (outputs of 3, 4, 5 tokens) ban the stop ids, rows 3.. do not
    assert torch.isinf(block[:3, [0, 2]]).all() and torch.isfinite(block[3:, [0, 2]]).all()


def test_neutral_parameters_build_no_processor_and_raw_logits_stay() -> None:
    assert build_processor(SamplingParams(), [1, 2], {0}, V) is None
    logits = torch.randn(2, V)
    raw = logits.clone()
    build_processor(ALL, [1], {0}, V).apply(logits, [1], [3])
    assert torch.equal(logits, raw)  # the engine's logprobs come from the untouched raw logits


def test_min_p_after_temperature_before_top_k_top_p() -> None:
    """vLLM's min-p: after temperature, a token survives when its probability >= min_p x the top one."""
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0, 1.9]])
    p = SamplingParams(temperature=0.5, min_p=0.5)
    probs = processed_probs(logits, p)
    scaled = torch.softmax(logits / 0.5, dim=-1)
    keep = scaled >= 0.5 * scaled.max()
    expected = torch.where(keep, scaled, torch.zeros_like(scaled))
    assert torch.allclose(probs, expected / expected.sum(), atol=1e-6)
    raw = torch.softmax(logits, dim=-1)
    assert keep.sum() == 2 and (raw >= 0.5 * raw.max()).sum() == 3  # before the temperature, token 1 would stay
    top_k = processed_probs(logits, SamplingParams(temperature=0.5, min_p=0.5, top_k=1))
    assert (top_k > 0).sum() == 1
    greedy = processed_probs(logits, SamplingParams(min_p=0.9))
    assert greedy.argmax() == 0 and greedy.sum() == 1.0


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 999),
])
def test_bad_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=10, **{field: value}).validate()


def test_logit_bias_id_outside_the_vocabulary_is_refused() -> None:
    models, _ = demo()
    with pytest.raises(ValueError, match="logit_bias"):
        models.engine.add_request([1, 2, 3], SamplingParams(logit_bias={10 ** 6: 1.0}))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_control_speculative_equals_plain(sampled: bool) -> None:
    """Each control changes the output, and the DFlash engine's output equals the plain engine's under it."""
    models, _ = demo()
    tok = models.tokenizer
    eos = models.engine.eos_token_ids[0]
    space = tok.encode(" 5", add_special_tokens=False)[0]  # the lone space before a number
    so = tok.encode("So", add_special_tokens=False)[0]
    base = dict(max_tokens=48, temperature=0.8 if sampled else 0.0, seed=11)
    controls = {
        "none": SamplingParams(**base),
        "presence": SamplingParams(**base, presence_penalty=1.5),
        "frequency": SamplingParams(**base, frequency_penalty=1.2),
        "repetition": SamplingParams(**base, repetition_penalty=1.8),
        "ban": SamplingParams(**base, logit_bias={space: -100.0}),
        "force": SamplingParams(**{**base, "max_tokens": 8}, logit_bias={so: 100.0}),
        "min_tokens": SamplingParams(**base, min_tokens=44),
        "min_p": SamplingParams(**base, min_p=0.3),
    }
    ps = prompts()[::2]  # answers of 30 to 40 tokens
    names = [n for n in controls for _ in ps]
    batch = [p for _ in controls for p in ps]
    spec, plain = both(batch, [controls[n] for n in names])
    for name, a, b in zip(names, spec, plain):
        assert a.token_ids == b.token_ids, (name, tok.decode(a.token_ids), tok.decode(b.token_ids))
    assert accepted_drafts(spec) > 20  # speculation ran
    by = {n: [o.token_ids for m, o in zip(names, spec) if m == n] for n in controls}
    for name in ("presence", "frequency", "repetition", "ban", "min_tokens"):
        assert by[name] != by["none"], name  # the control changed the output
    assert all(space in ids for ids in by["none"]) and not any(space in ids for ids in by["ban"])
    assert all(ids == [so] * 8 for ids in by["force"])
    assert all(len(ids) >= 44 and eos not in ids[:44] for ids in by["min_tokens"])
    assert all(len(ids) < 44 for ids in by["none"])


@pytest.mark.parametrize("control", ["logit_bias", "penalties", "grammar"])
def test_logprobs_are_the_raw_model_distribution_under_every_control(control: str) -> None:
    """Logprobs (chosen token and top alternatives) are the target's raw log-softmax at each position, not the
    distribution after logit_bias, the penalties or the grammar mask; checked against the target model run on the
    whole output at once, on the speculative engine (verify rows) and on the plain one (one row a step)."""
    models, plain = demo()
    tok = models.tokenizer
    so = tok.encode("So", add_special_tokens=False)[0]
    base = dict(max_tokens=12, temperature=0.0, logprobs=3)
    params = {
        "logit_bias": SamplingParams(**base, logit_bias={so: 100.0}),  # "So" every time
        "penalties": SamplingParams(**base, presence_penalty=1.5, frequency_penalty=1.2, repetition_penalty=1.8),
        "grammar": SamplingParams(**base, structured=StructuredOutput("json_object")),
    }[control]
    prompt = prompts()[1]
    for engine in (models.engine, plain):
        (out,) = run_to_completion(engine, [prompt], params)
        ids = out.token_ids
        assert len(out.logprobs) == len(ids) > 0
        with torch.no_grad():
            logits = engine.target.model(torch.tensor([prompt + ids])).logits[0].float()
        raw = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)], dim=-1)
        processed = build_processor(params, prompt, set(engine.eos_token_ids), raw.shape[-1])
        moved = 0.0
        for i, lp in enumerate(out.logprobs):
            assert lp.token_id == ids[i]
            assert lp.logprob == pytest.approx(float(raw[i, ids[i]]), abs=1e-3), (control, i)
            top_v, top_i = raw[i].topk(3)
            assert [t for t, _ in lp.top] == top_i.tolist(), (control, i)
            assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-3), (control, i)
            if processed is not None and control != "grammar":  # the grammar's state is the request's own
                after = torch.log_softmax(processed.apply(logits[len(prompt) - 1 + i][None], ids[:i], [])[0], -1)
                moved = max(moved, abs(float(after[ids[i]]) - lp.logprob))
        if control == "grammar":
            assert tok.decode(ids).lstrip().startswith("{")  # the mask did act: an object, not the usual answer
            assert any(float(raw[i].max()) - float(raw[i, t]) > 1e-3 for i, t in enumerate(ids))  # off the argmax
        else:
            assert moved > 0.1, control  # the control did move the distribution the token was chosen from
