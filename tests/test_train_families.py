"""dflash-train for every target family: dense (qwen3, llama, qwen2), MoE (qwen3_moe, gpt_oss) and hybrid Gated
DeltaNet (qwen3_5, qwen3_5_moe, qwen3_next) on the native runner, and the generic runner's families (gpt_oss,
gemma4, minimax_m2, glm4_moe, deepseek_v3, kimi_k25, mistral, phi3, glm_moe_dsa). Each tiny target gets a draft
trained for a few steps; the engine loads the pair, greedy output with the draft equals plain decoding, and four
concurrent chat requests of different lengths served over HTTP (the real `openai` client against uvicorn on
127.0.0.1) answer as plain decoding does. Also: the draft's MLP width and RoPE as taken from target configs (no
model needed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash_core import train
from tests.helpers import make_target, make_tokenizer

# qwen3_5_vl: Qwen3.5 as the hub stores it (Qwen3_5ForConditionalGeneration, a vision tower beside the text model),
# which transformers loads as the text-only Qwen3_5ForCausalLM
FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_moe", "qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "gpt_oss",
            "gemma4", "minimax_m2", "glm4_moe", "deepseek_v3", "kimi_k25", "mistral", "phi3", "glm_moe_dsa")
# built by tests.helpers.make_target
HELPER_FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_moe", "qwen3_5", "gemma4", "minimax_m2", "glm4_moe", "deepseek_v3",
                   "kimi_k25", "mistral", "phi3", "glm_moe_dsa")
GENERIC = ("gpt_oss", "gemma4", "minimax_m2", "glm4_moe", "deepseek_v3", "kimi_k25", "mistral", "phi3",
           "glm_moe_dsa")  # auto: generic
COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False, eos_token_id=2,
              pad_token_id=0, bos_token_id=None)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def family_config(family: str, vocab_size: int) -> Any:
    """Hub-like tiny configs of the families `make_target` does not build as their hub configs are: Qwen3.5 with a
    vision tower, Qwen3.5-MoE without `intermediate_size` (its published text config has none), Qwen3-Next, and
    gpt-oss (sliding window and full attention alternating, YaRN RoPE, biased attention)."""
    from transformers import GptOssConfig, Qwen3NextConfig
    from transformers.models.qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    if family == "qwen3_5_vl":
        text = dict(vocab_size=vocab_size, intermediate_size=128, **COMMON, **LINEAR)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(vocab_size=vocab_size, **COMMON, **LINEAR, **MOE,
                                    shared_expert_intermediate_size=32)
    if family == "qwen3_next":
        return Qwen3NextConfig(vocab_size=vocab_size, intermediate_size=128, **COMMON, **LINEAR, **MOE,
                               shared_expert_intermediate_size=32, decoder_sparse_step=1)
    if family == "gpt_oss":
        return GptOssConfig(vocab_size=vocab_size, intermediate_size=32, **COMMON, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8, rope_parameters=dict(GPT_OSS_ROPE))
    raise ValueError(family)


def build_target(folder: Path, family: str, vocab_size: int) -> Any:
    """A tiny random target of `family` saved to `folder`."""
    from transformers import AutoModelForCausalLM

    if family in HELPER_FAMILIES:
        return make_target(folder, arch=family, vocab_size=vocab_size)
    torch.manual_seed(0)
    cfg = family_config(family, vocab_size)
    if family == "qwen3_5_vl":
        from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

        Qwen3_5ForConditionalGeneration(cfg).save_pretrained(str(folder))
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(folder))
    return model.eval()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("train_families")
    tok = make_tokenizer(root / "tokenizer")
    data = root / "data.jsonl"
    rows: list[dict[str, Any]] = [{"messages": [{"role": "user", "content": f"Tell me about {i} foxes"}]}
                                  for i in range(3)]
    rows.append({"prompt": "def add(a, b):", "response": "\n    return a + b\n"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "tok": tok, "data": data}


def greedy(models: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy token ids of `prompts` through the loaded engine."""
    from dflash_core.generate import run_to_completion
    from dflash_core.sampling import SamplingParams

    return [r.token_ids for r in run_to_completion(models.engine, prompts, SamplingParams(max_tokens=n,
                                                                                           temperature=0.0))]


@pytest.mark.parametrize("family", FAMILIES)
def test_train_then_serve_every_family(family: str, workspace: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    from dflash_core.chat import encode_chat
    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models

    root, tok = workspace["root"], workspace["tok"]
    target, out = root / f"target-{family}", root / f"draft-{family}"
    tok.save_pretrained(str(target))
    model = build_target(target, family, len(tok))
    tcfg = model.config.get_text_config()
    rc = train.main(["--target", str(target), "--data", str(workspace["data"]), "--output", str(out), "--steps", "3",
                     "--batch-size", "2", "--anchors", "2", "--block-size", "4", "--max-new-tokens", "6",
                     "--save-every", "0", "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    cfg = json.loads((out / "config.json").read_text())
    # MLA configs (deepseek_v3, kimi_k25) name their RoPE part head_dim: the draft takes it
    assert cfg["hidden_size"] == 64 and cfg["num_target_layers"] == 4
    assert cfg["head_dim"] == (8 if family in ("deepseek_v3", "kimi_k25", "glm_moe_dsa") else 16)
    assert cfg["dflash_config"]["mask_token_id"] == tok.convert_tokens_to_ids("<|mask|>")
    assert cfg["rope_theta"] == train.rope_theta(tcfg)
    assert cfg["intermediate_size"] == {"qwen3_5_moe": 32 * 2 + 32, "gpt_oss": 32}.get(family, 128)
    if family == "qwen3_5_moe":  # no intermediate_size in the config: the active MoE width, said on stderr
        assert "draft MLP width 96" in err
    if family == "gpt_oss":  # YaRN: the draft implements it, so it is carried over (no fallback note)
        assert cfg["rope_scaling"] == {k: v for k, v in GPT_OSS_ROPE.items() if k != "rope_theta"}
        assert "RoPE type 'yarn'" not in err

    spec = load_models(EngineConfig(str(target), str(out), device="cpu", dtype="float32", max_running_requests=2))
    plain = load_models(EngineConfig(str(target), None, speculative=False, device="cpu", dtype="float32",
                                     max_running_requests=2))
    assert spec.block_size == 4
    assert spec.backend == ("generic" if family in GENERIC else "native")
    prompts = [encode_chat(tok, [{"role": "user", "content": text}]) for text in ("Hello there", "How many foxes?")]
    assert greedy(spec, prompts, 12) == greedy(plain, prompts, 12)
    served_over_http(spec, plain, target, out)

    # the features the draft trained on are the ones the serving runner hands it (padded batch rows included)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    long, short = sorted(prompts, key=len, reverse=True)
    ids = torch.zeros(2, len(long), dtype=torch.long)
    att = torch.zeros_like(ids)
    for r, p in enumerate((long, short)):
        ids[r, : len(p)], att[r, : len(p)] = torch.tensor(p), 1
    with torch.no_grad():
        trained = train.context_features(model, ids, att, layer_ids)
    runner = spec.engine.target
    for r, p in enumerate((long, short)):
        with spec.engine.kv.borrow(len(p)) as blocks:
            served = runner.forward(p, 0, runner.new_cache(r, blocks), features=True).features
        assert served is not None
        torch.testing.assert_close(trained[r, : len(p)], served, atol=2e-4, rtol=1e-3)


def test_mlp_width_falls_back_for_configs_without_intermediate_size() -> None:
    from transformers import Qwen3Config
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    assert train.mlp_width(Qwen3Config(hidden_size=64, intermediate_size=200))[0] == 200
    moe = Qwen3_5MoeTextConfig(hidden_size=2048, moe_intermediate_size=512, num_experts_per_tok=8,
                               shared_expert_intermediate_size=512)
    assert getattr(moe, "intermediate_size", None) is None  # as the published Qwen3.5-35B-A3B text config
    assert train.mlp_width(moe)[0] == 512 * 8 + 512
    assert train.mlp_width(SimpleNamespace(hidden_size=64))[0] == 3 * 64  # neither a dense nor an MoE width


def test_draft_rope_copies_theta_and_supported_types() -> None:
    from transformers import LlamaConfig
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    theta, scaling, note = train.draft_rope(LlamaConfig(rope_parameters=dict(llama3)), 128)
    assert theta == 500000.0 and note is None
    assert scaling == {k: v for k, v in llama3.items() if k != "rope_theta"}
    # Qwen3.5: partial rotary and multimodal sections in the target; the draft rotates whole heads, default type
    qwen35 = Qwen3_5TextConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                "mrope_interleaved": True})
    assert train.draft_rope(qwen35, 256) == (1e7, None, None)
    # a type no implementation knows: default RoPE with the target's theta, and a note that says so
    odd = LlamaConfig()
    odd.rope_parameters = {"rope_type": "no-such-rope", "rope_theta": 1234.0}
    theta, scaling, note = train.draft_rope(odd, 64)
    assert (theta, scaling) == (1234.0, None) and note is not None and "'no-such-rope'" in note


def test_cached_features_keep_massive_activations_finite() -> None:
    """--cache-hidden stores fp16, and bf16 for a sequence whose hidden states exceed fp16's range."""
    small, massive = torch.tensor([[1.5, -300.0]]), torch.tensor([[1.5, -9e4]])
    assert train.loop.compact(small).dtype == torch.float16
    kept = train.loop.compact(massive)
    assert kept.dtype == torch.bfloat16 and torch.isfinite(kept).all()
    assert kept.float()[0, 1].item() == pytest.approx(-9e4, rel=1e-2)


HTTP_QUESTIONS = ("Hi", "Tell me about 2 foxes", "def add(a, b): what does it return, and why?",
                  "Unit conversions: how many metres are 3 feet? " * 4)


def served_over_http(spec: Any, plain: Any, target: Path, draft: Path) -> None:
    """Four concurrent chat completions of different lengths through the real `openai` client against the app on
    uvicorn (127.0.0.1), served by `spec` (the engine with the draft): each answer is plain decoding's."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from dflash_core.chat import encode_chat
    from server import app as server_app
    from server.settings import Settings
    from tests.server_fixtures import InProcessServer

    tok = spec.tokenizer
    expected = [tok.decode(ids, skip_special_tokens=True)
                for ids in greedy(plain, [encode_chat(tok, [{"role": "user", "content": q}]) for q in HTTP_QUESTIONS],
                                  10)]
    settings = Settings(target=str(target), draft=str(draft), device="cpu", served_model_name="tiny", one_core=False,
                        generation_config="none")
    server = InProcessServer(server_app.create_app(settings, models=spec)).start()
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask(question: str) -> str:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                               max_tokens=10, temperature=0)
            return r.choices[0].message.content or ""

        with ThreadPoolExecutor(len(HTTP_QUESTIONS)) as pool:
            answers = list(pool.map(ask, HTTP_QUESTIONS))
    finally:
        server.stop()
    assert answers == expected and any(answers)
