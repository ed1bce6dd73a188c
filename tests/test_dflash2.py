"""DFlash 2 drafts: the checkpoint loads and serves; its proposals equal a from-scratch reference of the equations
(the grouped dynamic causal convolution, the candidate selector's walk) on the batched and the per-request paths;
greedy and seeded output equal plain decoding; a config field missing or inconsistent is one error naming it.

The drafts are the demo draft's weights with the DFlash 2 parts added (small random convolution kernels and
codebooks, non-causal sliding-window attention, an output multiplier and a soft-cap): it is still accepted often, so
the engine runs partial and full acceptances. With identity kernels and zero codebooks it must propose exactly what
the demo draft does.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash_core.config import DFlash2Config, DraftConfig, EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.engine import Engine
from dflash_core.generate import run_to_completion
from dflash_core.loading import DEMO_DRAFT, LoadedModels, load_models
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.sampling import SamplingParams
from tests.helpers import RecordingDrafter
from tests.test_draft_reference import demo_prompts
from tests.test_engine import run_all, tokens

BLOCK = 8
NEW_TOKENS = 32
FIELDS = DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def dflash2_draft(folder: Path, identity: bool = False, seed: int = 0) -> DFlashDraft:
    """The demo draft made a DFlash 2 draft (see the module docstring), saved to `folder` in z-lab format."""
    demo = DFlashDraft.from_folder(DEMO_DRAFT)
    cfg = replace(demo.cfg, dflash2=FIELDS, is_causal=False, sliding_window=64,
                  layer_types=["sliding_attention"] * demo.cfg.num_hidden_layers,
                  output_multiplier=1.0 if identity else 0.9, final_logit_softcapping=None if identity else 30.0)
    draft = DFlashDraft(cfg)
    missing, unexpected = draft.load_state_dict(demo.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0  # identity: this row's value, no neighbour
                if not identity:
                    conv.base_kernel.add_(0.05 * torch.randn(conv.base_kernel.shape, generator=gen))
                    conv.kernel_projection.weight.copy_(
                        0.02 * torch.randn(conv.kernel_projection.weight.shape, generator=gen))
                else:
                    conv.kernel_projection.weight.zero_()
        sel = draft.candidate_selector
        for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            p.copy_(torch.zeros_like(p) if identity else 0.3 * torch.randn(p.shape, generator=gen))
    draft.save(folder)
    return draft


# --- the reference, from the equations ------------------------------------------------------------------------

def ref_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """out[i, c] = sum_{t < K, i - t >= 0} (base[t, c] + delta[i, t, c // group]) * x[i - t, c]; x [q, H]."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(base.shape[0]):
            if i - t >= 0:
                kernel = base[t] + torch.stack([delta[i, t, c // group] for c in range(x.shape[1])])
                out[i] += kernel * x[i - t]
    return out


def ref_layer(layer, x, cos, sin, ctx_k, ctx_v, mask):  # noqa: ANN001, ANN201
    """One DFlash 2 layer over one block x [q, H]: convolution, sublayer, convolution, for attention and MLP."""
    for norm, conv, sub in ((layer.input_layernorm, layer.attention_conv,
                             lambda h: layer.self_attn(h[None], cos, sin, ctx_k, ctx_v, mask)[0]),
                            (layer.post_attention_layernorm, layer.mlp_conv, lambda h: layer.mlp(h))):
        h = norm(x)
        taps, groups = conv.base_kernel.shape[1], h.shape[1] // FIELDS.conv_group_size
        delta = conv.kernel_projection(h).view(h.shape[0], 2, taps, groups)
        h = ref_conv(h, conv.base_kernel[0], delta[:, 0], FIELDS.conv_group_size)
        x = x + ref_conv(sub(h), conv.base_kernel[1], delta[:, 1], FIELDS.conv_group_size)
    return x


def ref_walk(draft: DFlashDraft, hidden: torch.Tensor, logits: torch.Tensor, first: int) -> list[int]:
    """The selector's greedy path: score[l, p, c] = unary[l, c] + sum_r A[pred_p, r] hp[l, r] B[cand[l, c], r]
    over every predecessor p (the first token for l = 0, else the candidates of l - 1), then the walk."""
    sel = draft.candidate_selector
    unary, cand = torch.topk(logits, FIELDS.selector_top_k, dim=-1)
    hp = sel.hidden_projection(hidden)
    a, b = sel.predecessor_codebook, sel.successor_codebook
    prev, path = 0, []
    for pos in range(logits.shape[0]):
        preds = torch.full((FIELDS.selector_top_k,), first) if pos == 0 else cand[pos - 1]
        score = torch.stack([torch.stack([unary[pos, c] + (a[preds[p]] * hp[pos] * b[cand[pos, c]]).sum()
                                          for c in range(FIELDS.selector_top_k)])
                             for p in range(FIELDS.selector_top_k)])
        prev = int(score[prev].argmax())
        path.append(int(cand[pos, prev]))
    return path


@torch.inference_mode()
def reference_proposal(model, draft: DFlashDraft, prefix: list[int], last: int, n: int) -> list[int]:  # noqa: ANN001
    """The n tokens the DFlash 2 draft proposes after `last` at position len(prefix), from scratch: the target's
    hidden states of the whole prefix, the context keys of every layer, the block through `ref_layer`."""
    out = model(input_ids=torch.tensor([prefix]), use_cache=False, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in draft.cfg.target_layer_ids], dim=-1)
    p = len(prefix)
    block = torch.tensor([[last] + [draft.mask_token_id] * n])
    x = draft.embed(block, model.get_input_embeddings().weight)[0]
    block_pos, ctx_pos = torch.arange(p, p + n + 1)[None], torch.arange(p)[None]
    cos, sin = draft.rope(block_pos, x.dtype)
    ctx = draft.hidden_norm(draft.fc(feats[None]))
    cos_c, sin_c = draft.rope(ctx_pos, x.dtype)
    keys = torch.cat([ctx_pos, block_pos], dim=1)
    for layer in draft.layers:
        ctx_k, ctx_v = layer.self_attn.context_kv(ctx, cos_c, sin_c)
        window = layer.self_attn.sliding_window
        qp, kp = block_pos[0][:, None], keys[0][None, :]
        mask = ((qp - kp).abs() < window)[None, None]  # non-causal: both directions within the window
        x = ref_layer(layer, x, cos, sin, ctx_k, ctx_v, mask)
    hidden = draft.norm(x)[1:]
    logits = draft.logits(hidden, model.get_output_embeddings().weight).float()
    return ref_walk(draft, hidden, logits, last)


@pytest.fixture(scope="module", params=["hf", "native"])
def served(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModels, Path]:
    folder = tmp_path_factory.mktemp("dflash2") / "draft"
    dflash2_draft(folder)
    return load_models(EngineConfig(draft=str(folder), block_size=BLOCK, backend=request.param,
                                    max_running_requests=4, speculation="fixed")), folder


def test_dflash2_proposals_equal_the_reference_and_output_equals_plain_decoding(served) -> None:
    models, _ = served
    assert models.engine.drafter.draft.candidate_selector is not None
    target = models.engine.target
    slots = dict(max_slots=4, max_len=target.max_len) if models.backend == "native" else {}
    recorder = RecordingDrafter(DFlashDrafter(models.engine.drafter.draft, target, BLOCK, **slots))
    engine = Engine(target, recorder, eos_token_ids=[], max_model_len=models.engine.max_model_len)
    prompts = demo_prompts(models, 3)
    params = [SamplingParams(max_tokens=NEW_TOKENS), SamplingParams(max_tokens=NEW_TOKENS - 5),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=5)]
    ids = {engine.add_request(p, sp): tuple(p) for p, sp in zip(prompts, params)}
    outs = run_all(engine)
    plain = load_models(EngineConfig(backend=models.backend, speculative=False)).engine
    for rid, prompt in ids.items():
        expected = run_to_completion(plain, [list(prompt)], [params[list(ids).index(rid)]])[0].token_ids
        assert tokens(outs[rid]) == expected  # greedy and seeded: the target's own tokens
    lengths = [s.acceptance_length for steps in outs.values() for s in steps if s.num_draft_tokens]
    assert max(lengths) > 2 and min(lengths) < BLOCK, lengths  # accepted and rejected proposals both occur
    sequences = {prompt: tokens(outs[rid]) for rid, prompt in ids.items()}
    draft = models.engine.drafter.draft
    for prop in recorder.proposals[:12]:
        seq = list(prop.prompt) + sequences[prop.prompt]
        expected = reference_proposal(target.model, draft, seq[: prop.position], prop.last_token, len(prop.tokens))
        assert prop.tokens == expected, f"position {prop.position}"


def test_identity_kernels_and_zero_codebooks_propose_what_the_dflash_draft_does(tmp_path: Path) -> None:
    dflash2_draft(tmp_path / "identity", identity=True)
    prompts = demo_prompts(load_models(EngineConfig(speculative=False)), 2)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    runs = []
    for folder in (tmp_path / "identity", DEMO_DRAFT):
        cfg = EngineConfig(draft=str(folder), block_size=BLOCK, speculation="fixed")
        runs.append([(o.token_ids, o.stats.num_accepted_tokens) for o in  # type: ignore[union-attr]
                     run_to_completion(load_models(cfg).engine, prompts, params)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("edit, words", [
    (lambda c: c["dflash_config"].pop("conv_group_size"), "dflash_config.conv_group_size"),
    (lambda c: c["dflash_config"].update(conv_group_size=48), "conv_group_size 48 does not divide hidden_size"),
    (lambda c: c["dflash_config"].update(selector_top_k=0), "dflash_config.selector_top_k must be >= 1"),
    (lambda c: c["dflash_config"].update(selector_rank="8"), "dflash_config.selector_rank must be an integer"),
    (lambda c: c.update(draft_vocab_size=1000), "draft_vocab_size 1000: a DFlash 2 draft"),
])
def test_a_missing_or_inconsistent_field_stops_start_up_naming_it(tmp_path: Path, edit, words) -> None:  # noqa: ANN001
    folder = tmp_path / "draft"
    dflash2_draft(folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_models(EngineConfig(draft=str(folder)))


def test_the_config_round_trips(tmp_path: Path) -> None:
    draft = dflash2_draft(tmp_path / "draft")
    again = DraftConfig.from_file(tmp_path / "draft")
    assert again.dflash2 == FIELDS and again.first_difference(draft.cfg) is None
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
