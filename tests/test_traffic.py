"""`--record-traffic`: finished requests as JSON lines (prompt and output token ids, acceptance), never those that
say `"store": false`, in size-rotated shards written off the worker thread; a failed write stops recording with one
log line and serving goes on (a real server's recording: tests/test_server_e2e.py). dflash-train continues a draft on
the records and gates it against the old one."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from pathlib import Path

import pytest

from server.metrics import ServerMetrics
from server.traffic import TrafficRecord, TrafficRecorder, shard_paths
from server.worker import Worker
from tests.fake_engine import Script, demo_tokenizer, wait_until
from tests.server_fixtures import start_server
from tests.test_worker_fake import events, handle, new_engine, run


def record(i: int, n_output: int = 20) -> TrafficRecord:
    return TrafficRecord(id=f"chatcmpl-{i}-0", created=1.0, model="m", prompt_token_ids=list(range(i, i + 10)),
                         output_token_ids=list(range(n_output)), finish_reason="stop", num_drafts=2,
                         num_draft_tokens=30, num_accepted_tokens=9, mean_acceptance_length=5.5)


def read_records(folder: Path) -> list[dict]:
    return [json.loads(line) for p in shard_paths(folder) for line in p.read_text().splitlines()]


def test_records_rotate_by_size_and_close_writes_what_is_queued(tmp_path: Path) -> None:
    recorder = TrafficRecorder(tmp_path / "traffic", max_bytes=1024)
    for i in range(40):
        recorder.record(record(i))
    recorder.close()
    shards = shard_paths(tmp_path / "traffic")
    assert len(shards) > 5 and all(p.stat().st_size <= 1024 for p in shards)
    rows = read_records(tmp_path / "traffic")
    assert [r["id"] for r in rows] == [f"chatcmpl-{i}-0" for i in range(40)]
    assert rows[3] == {**record(3).__dict__}
    assert recorder.written == 40 and not recorder.recording
    recorder.record(record(99))  # after close: dropped, no error
    assert len(read_records(tmp_path / "traffic")) == 40


def test_a_failed_write_stops_recording_with_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recorder = TrafficRecorder(tmp_path, max_bytes=1 << 20)

    def full_disk(line: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    recorder._write = full_disk  # type: ignore[method-assign]  # the disk fills up
    with caplog.at_level(logging.ERROR, logger="dflash.traffic"):
        for i in range(5):
            recorder.record(record(i))
        wait_until(lambda: not recorder.recording, what="recording to stop")
        recorder.record(record(9))  # returns at once: recording is off
        recorder.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash.traffic"]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "serving goes on" in lines[0]


class ListSink:
    def __init__(self) -> None:
        self.records: list[TrafficRecord] = []

    def record(self, rec: TrafficRecord) -> None:
        self.records.append(rec)


def test_the_worker_records_finished_requests_unless_store_is_false() -> None:
    engine = new_engine(block_size=4)
    engine.script("kept", Script([[10], [11, 12, 13], "tail"], finish_reason="stop"))
    engine.script("private", Script(["not recorded"]))
    engine.script("gone", Script(["x", "y" * 40]))
    sink = ListSink()

    async def test() -> None:
        metrics = ServerMetrics(block_size=4, target="fake", draft="fake", device="cpu", backend="fake")
        worker = Worker(engine, demo_tokenizer(), metrics, max_running=4, max_waiting=4, recorder=sink,
                        model_name="served")
        worker.start()
        try:
            kept, private, cut = handle("kept"), handle("private", index=1), handle("gone", max_tokens=3, index=2)
            kept.record = cut.record = True
            private.record = False  # "store": false
            worker.submit([kept, private, cut])
            got = {h.request_id: await events(h) for h in (kept, private, cut)}
            await asyncio.to_thread(wait_until, lambda: len(engine.released) == 3, what="all released")
        finally:
            await asyncio.to_thread(worker.stop)
        by_id = {r.id: r for r in sink.records}
        assert set(by_id) == {kept.request_id, cut.request_id}
        rec = by_id[kept.request_id]
        tok = demo_tokenizer()
        assert rec.model == "served" and rec.prompt_token_ids == kept.prompt_token_ids
        assert tok.decode(rec.output_token_ids) == "".join(ev.text for ev in got[kept.request_id])
        summary = engine.final_stats[engine.request_id("kept")].summary()
        assert rec.finish_reason == "stop" and rec.num_drafts == summary.num_drafts > 0
        assert rec.num_accepted_tokens == summary.num_accepted_tokens
        assert by_id[cut.request_id].finish_reason == "length" and len(by_id[cut.request_id].output_token_ids) == 3

    run(test)


def test_an_unwritable_folder_stops_start_up_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    server = start_server(["--device", "cpu", "--record-traffic", str(blocker / "sub")], tmp_path / "log")
    assert server.proc.wait(timeout=60) != 0
    assert "--record-traffic" in server.log_tail() and "Traceback" not in server.log_tail()


def test_dflash_train_continues_a_draft_on_recorded_traffic(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`dflash-train --init-draft DRAFT --data FOLDER`: the recorded outputs are the responses (nothing is
    generated), a slice chosen by request id is held out and written to OUTPUT/heldout.jsonl, the draft keeps its
    architecture, block size, target layers and mask token while its weights move, and the gate measures old and
    new drafts on the held-out slice (OUTPUT/gate.json); the result serves losslessly. A draft that does not fit
    the target is refused in one line."""
    import torch
    from safetensors.torch import load_file

    from dflash_core import train
    from dflash_core.config import EngineConfig
    from dflash_core.draft_formats import read_draft_config
    from dflash_core.generate import run_to_completion
    from dflash_core.loading import load_models
    from dflash_core.sampling import SamplingParams
    from dflash_core.train.traffic import held_out
    from tests.helpers import make_draft, make_tiny_pair
    from tests.test_engine import hf_greedy

    target, draft = make_tiny_pair(tmp_path, block_size=8)
    model = load_models(EngineConfig(str(target), None, device="cpu")).engine.target.model
    folder = tmp_path / "traffic"
    recorder = TrafficRecorder(folder, max_bytes=4096)  # several shards
    g = torch.Generator().manual_seed(0)
    for i in range(24):
        prompt = torch.randint(4, 300, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        recorder.record(TrafficRecord(id=f"chatcmpl-{i}-0", created=0.0, model="tiny", prompt_token_ids=prompt,
                                      output_token_ids=hf_greedy(model, prompt, 24), finish_reason="length",
                                      num_drafts=1, num_draft_tokens=7, num_accepted_tokens=2,
                                      mean_acceptance_length=3.0))
    recorder.close()
    assert len(shard_paths(folder)) > 1
    out = tmp_path / "continued"
    rc = train.main(["--target", str(target), "--data", str(folder), "--init-draft", str(draft), "--output", str(out),
                     "--heldout-fraction", "0.25", "--steps", "4", "--batch-size", "4", "--anchors", "2",
                     "--save-every", "0", "--threads", "1", "--lr", "1e-2", "--eval-heldout", "--eval-n", "3",
                     "--eval-max-new-tokens", "8", "--gate-margin", "0.1"])
    err = capsys.readouterr()
    assert rc == 0, err.err
    heldout = [json.loads(line)["id"] for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert heldout == [f"chatcmpl-{i}-0" for i in range(24) if held_out(f"chatcmpl-{i}-0", 0.25)] and heldout
    assert f"{24 - len(heldout)} requests to train on, {len(heldout)} held out" in err.out
    # the gate: old and new drafts on the same held-out prompts, the new promoted only 10% better
    report = json.loads((out / "gate.json").read_text())
    old_len, new_len = report["old"]["acceptance_length"], report["new"]["acceptance_length"]
    assert report["old"]["prompts"] == report["new"]["prompts"] == min(3, len(heldout)) and report["margin"] == 0.1
    assert report["promote"] == (new_len >= 1.1 * old_len) and report["old"]["draft"] == str(draft)
    assert f"gate: held-out acceptance length {old_len:.2f} (old) -> {new_len:.2f} (new)" in err.out
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["gate"] == report and summary["eval"]["acceptance_length"] == new_len
    before, after = read_draft_config(draft), read_draft_config(out)
    assert (after.block_size, after.target_layer_ids, after.mask_token_id, after.num_hidden_layers) == (
        before.block_size, before.target_layer_ids, before.mask_token_id, before.num_hidden_layers)
    w0, w1 = load_file(str(draft / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert w0.keys() == w1.keys() and any(not torch.equal(w0[k], w1[k]) for k in w0)
    spec = load_models(EngineConfig(str(target), str(out), device="cpu", max_running_requests=2))
    plain = load_models(EngineConfig(str(target), None, speculative=False, device="cpu", max_running_requests=2))
    prompts = [[5, 6, 7, 8], list(range(40, 70))]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    assert ([r.token_ids for r in run_to_completion(spec.engine, prompts, params)]
            == [r.token_ids for r in run_to_completion(plain.engine, prompts, params)])

    other = make_draft(tmp_path / "wide-draft", vocab_size=500)  # another vocabulary
    assert other is not None
    rc = train.main(["--target", str(target), "--data", str(folder), "--init-draft", str(tmp_path / "wide-draft"),
                     "--output", str(tmp_path / "refused"), "--steps", "1"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("dflash-train: error: --init-draft:") and "vocab_size" in last
    assert "Traceback" not in err and not (tmp_path / "refused").exists()


def test_a_half_written_last_record_is_not_read_and_dflash_bench_runs_the_records(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A server may be appending to the newest shard while dflash-train reads the folder: its last line, without
    its newline yet, is left out. `dflash-bench offline --dataset` reads recorded requests as token-id prompts
    (no chat template); the HTTP modes refuse them."""
    from dflash_core.bench.cli import main as bench_main
    from dflash_core.bench.offline import prompt_ids
    from dflash_core.bench.prompts import read_prompts
    from dflash_core.train.traffic import read_traffic

    shard = tmp_path / "traffic-1-1-0001.jsonl"
    whole = [json.dumps({**record(i).__dict__}) for i in range(2)]
    shard.write_text("\n".join(whole) + "\n" + whole[0][:25])
    rows = read_traffic(tmp_path)
    assert [r["id"] for r in rows] == ["chatcmpl-0-0", "chatcmpl-1-0"]
    heldout = _complete(shard)
    prompts = read_prompts(heldout, "heldout")
    assert [p.token_ids for p in prompts] == [list(range(0, 10)), list(range(1, 11))]
    assert prompt_ids(None, prompts[1]) == list(range(1, 11))
    argv = ["serve", "--base-url", "http://127.0.0.1:9", "--dataset", str(heldout), "--no-plots", "--output-dir",
            str(tmp_path)]
    assert bench_main(argv) == 2
    assert "run in `dflash-bench offline` only" in capsys.readouterr().err


def _complete(shard: Path) -> Path:
    """The shard's whole lines, as dflash-train writes a held-out file."""
    out = shard.with_name("heldout.jsonl")
    out.write_text("".join(line for line in shard.read_text().splitlines(keepends=True) if line.endswith("\n")))
    return out
