"""dflash-train: the block recipe, a tiny end-to-end training run that the engine loads, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_core import train
from tests.helpers import make_draft, make_target, make_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    target = root / "target"
    tok = make_tokenizer(target)
    make_target(target, vocab_size=len(tok))
    data = root / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Tell me about {i} foxes"}]} for i in range(24)]
    rows += [{"prompt": "def add(a, b):", "response": "\n    return a + b\n"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = root / "heldout.jsonl"
    held.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Hello {i}"}]}) + "\n"
                            for i in range(3)))
    return {"root": root, "target": target, "data": data, "held": held}


def test_block_batch_semantics() -> None:
    gen = torch.Generator().manual_seed(0)
    seq = torch.arange(100, 120)  # tokens 100..119 at positions 0..19; response starts at 5
    batch = train.make_block_batch([seq], [5], block_size=4, n_anchors=3, mask_id=7, pad_id=0, gen=gen)
    B = 4
    pos = batch["block_pos"].view(3, B)
    anchors = pos[:, 0]
    assert (anchors >= 5).all() and (anchors <= 18).all()
    tokens = batch["block_tokens"].view(3, B)
    labels = batch["labels"].view(3, B)
    mask = batch["mask"][0, 0]  # [q, S + q]
    S = batch["tokens"].shape[1]
    for n, a in enumerate(anchors.tolist()):
        assert tokens[n, 0] == 100 + a and (tokens[n, 1:] == 7).all()
        assert pos[n].tolist() == list(range(a, a + B))
        assert labels[n, 0] == -100
        for k in range(1, B):
            assert labels[n, k] == (100 + a + k if a + k < 20 else -100)  # rows predict the token AT a+k
        for k in range(B):
            row = mask[n * B + k]
            assert row[:S].nonzero().flatten().tolist() == list(range(a))  # context strictly before the anchor
            blk = row[S:].nonzero().flatten().tolist()
            assert blk == list(range(n * B, n * B + B))  # own block, bidirectional


def test_loss_weights_and_tau_estimate() -> None:
    B, V = 4, 5
    labels = torch.tensor([[-100, 1, 2, 3]])
    logits = torch.full((1, B, V), -10.0)
    logits[0, 1, 1] = logits[0, 2, 2] = 10.0  # rows 1, 2 right, row 3 wrong
    logits[0, 3, 0] = 10.0
    loss, tau, n = train.block_loss(logits, labels, B, gamma=7.0)
    assert n == 1 and tau == pytest.approx(3.0)
    w = [math.exp(-(k - 1) / 7.0) for k in (1, 2, 3)]
    ce3 = torch.nn.functional.cross_entropy(logits[0, 3:4], labels[0, 3:4]).item()
    ce12 = torch.nn.functional.cross_entropy(logits[0, 1:3], labels[0, 1:3], reduction="none").tolist()
    expected = (w[0] * ce12[0] + w[1] * ce12[1] + w[2] * ce3) / sum(w)
    assert loss.item() == pytest.approx(expected, rel=1e-4)


def test_train_tiny_target_end_to_end(tiny: dict[str, Path]) -> None:
    out = tiny["root"] / "draft"
    rc = train.main([
        "--target", str(tiny["target"]), "--data", str(tiny["data"]), "--output", str(out), "--steps", "40",
        "--batch-size", "4", "--anchors", "4", "--block-size", "8", "--max-new-tokens", "32", "--lr", "3e-3",
        "--save-every", "15", "--cache-hidden", "--threads", "1",
        "--eval-data", str(tiny["held"]), "--eval-n", "3", "--eval-max-new-tokens", "24", "--eval-speedup",
    ])
    assert rc == 0
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert not (out / train.CHECKPOINT_DIR).exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"]["mask_token_id"] == 3  # the tokenizer's <|mask|>
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["eval"]["outputs_identical"] is True

    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models
    from dflash_core.sampling import SamplingParams

    spec = load_models(EngineConfig(str(tiny["target"]), str(out), device="cpu", dtype="float32"))
    ar = load_models(EngineConfig(str(tiny["target"]), None, device="cpu", dtype="float32", speculative=False))
    assert spec.block_size == 8
    prompt = spec.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                                add_generation_prompt=True)
    ids = spec.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    outs = []
    for models in (spec, ar):
        rid = models.engine.add_request(ids, SamplingParams(max_tokens=40, temperature=0.0))
        toks: list[int] = []
        while models.engine.has_unfinished():
            for o in models.engine.step():
                toks += o.new_token_ids
        outs.append(toks)
        models.engine.release(rid)
    assert outs[0] == outs[1]
    model = ar.engine.target.model if hasattr(ar.engine.target, "model") else None
    if model is not None:  # and both equal transformers' own greedy decoding
        ref = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                             eos_token_id=ar.engine.eos_token_ids, pad_token_id=0)[0, len(ids):].tolist()
        assert outs[0] == ref[: len(outs[0])]


def test_resume_continues_from_checkpoint(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    out = tiny["root"] / "resume"
    args = ["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--output", str(out), "--batch-size", "2",
            "--anchors", "2", "--block-size", "4", "--max-new-tokens", "8", "--save-every", "3", "--threads", "1",
            "--steps", "6"]
    real_loss = train.block_loss
    calls = {"n": 0}

    def crashing_loss(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(train.loop, "block_loss", crashing_loss)
    assert train.main(args) == 130
    assert (out / train.CHECKPOINT_DIR / "trainer_state.pt").exists()
    assert (out / train.DATA_FILE).exists() and not (out / "model.safetensors").exists()
    monkeypatch.setattr(train.loop, "block_loss", real_loss)
    assert train.main(args) != 0  # a non-empty output needs --resume
    assert train.main(args + ["--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (out / "model.safetensors").exists() and not (out / train.CHECKPOINT_DIR).exists()


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "dflash_core.train", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_help_documents_every_option() -> None:
    parser = train.build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} lacks help"
    res = _run_cli("--help")
    assert res.returncode == 0 and "--block-size" in res.stdout and "--resume" in res.stdout


def test_help_shows_every_default() -> None:
    """Every option that takes a value and is not required says its default in --help."""
    parser = train.build_parser()
    fmt = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.required or action.nargs == 0:
            continue
        assert "default" in fmt._get_help_string(action), f"{action.option_strings} does not show its default"
    text = parser.format_help()
    assert "(default: 2000)" in text and "(default: 16)" in text


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_weights_are_readable_by_others(tmp_path: Path, umask: int) -> None:
    """Final weights and checkpoints: 0644 / 0755 less the umask (safetensors and mkdtemp write 0600 / 0700,
    which the serving container's user cannot read)."""
    draft = make_draft(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    old = os.umask(umask)
    try:
        train.save_final(out, draft)
        opt = torch.optim.AdamW(draft.parameters())
        train.save_checkpoint(out, draft, opt, 1, torch.Generator())
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert (out / name).stat().st_mode & 0o777 == 0o644 & ~umask, name
    ckpt = out / train.CHECKPOINT_DIR
    assert ckpt.stat().st_mode & 0o777 == 0o755 & ~umask
    for f in ckpt.iterdir():
        assert f.stat().st_mode & 0o777 == 0o644 & ~umask, f.name


@pytest.mark.parametrize(
    "case", ["missing_target", "empty_data", "block_size", "unwritable", "missing_data", "not_empty"]
)
def test_bad_input_exits_nonzero_without_output(case: str, tiny: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "out" / "draft"
    args = {"target": str(tiny["target"]), "data": str(tiny["data"]), "output": str(out), "block": "16"}
    if case == "missing_target":
        args["target"] = str(tmp_path / "no_such_model")
    elif case == "empty_data":
        args["data"] = str(empty)
    elif case == "missing_data":
        args["data"] = str(tmp_path / "nope.jsonl")
    elif case == "block_size":
        args["block"] = "1"
    elif case == "unwritable":
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        if os.access(ro, os.W_OK):  # running as root: a path under a file is unwritable for everyone
            blocker = tmp_path / "file"
            blocker.write_text("x")
            args["output"] = str(blocker / "draft")
        else:
            args["output"] = str(ro / "draft")
    elif case == "not_empty":
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("x")
    rc = train.main(["--target", args["target"], "--data", args["data"], "--output", args["output"],
                     "--block-size", args["block"], "--steps", "2", "--threads", "1"])
    assert rc != 0
    if case == "not_empty":
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    else:
        assert not Path(args["output"]).exists()
        assert not (tmp_path / "out").exists()


def test_bad_input_message(tiny: dict[str, Path], tmp_path: Path) -> None:
    res = _run_cli("--target", str(tiny["target"]), "--data", str(tiny["data"]), "--output", str(tmp_path / "o"),
                   "--block-size", "1")
    assert res.returncode != 0 and "--block-size must be at least 2" in res.stderr
    assert "Traceback" not in res.stderr


def test_messages_rows_need_a_chat_template(tiny: dict[str, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """One policy (dflash_core.chat): without a chat template `messages` rows are refused, not given a made-up
    format; the message says what to do instead, and no output is left behind."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny["target"]))
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path / "plain_tok"))
    out = tmp_path / "out" / "draft"
    rc = train.main(["--target", str(tiny["target"]), "--tokenizer", str(tmp_path / "plain_tok"), "--data",
                     str(tiny["data"]), "--output", str(out), "--steps", "2", "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "chat template" in err and "'prompt'/'text' rows" in err
    assert not (tmp_path / "out").exists()
