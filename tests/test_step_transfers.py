"""Host <-> device transfers of a whole decode step (issue 23, finding 5): with static steps, every step's inputs
go to the device through `dflash_core.transfer.HostToDevice` (one copy per forward: the draft's, the target's, and
the sampling controls'), the host waits for the device exactly where it must read results (the draft's proposals,
the target's choices), and no other host data is copied to the device (`torch.tensor`, `torch.as_tensor`,
`Tensor.to(device)` are counted: on CPU a copy cannot be observed otherwise).

The static steps run uncompiled here (`StaticShapes(compiled=False)`: the same padded step and the same inputs as
the compiled one, without a compile's minutes).
"""

from __future__ import annotations

import pytest

from dflash_core.compile import StaticShapes
from dflash_core.engine import Engine
from dflash_core.grammar import StructuredOutput
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams
from dflash_core.transfer import count_transfers
from tests.demo_engines import demo, prompts
from tests.test_transfers import SCHEMA, uncounted_copies

CASES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.9, seed=7),
    "penalties": dict(temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={5: 2.0}),
    "grammar": dict(temperature=0.0, structured=StructuredOutput("json_schema", SCHEMA)),
}


def _engine(speculative: bool) -> Engine:
    models, _ = demo()
    base = models.engine.target
    static = StaticShapes(batch_sizes=(1, 2, 4), compiled=False)
    target = NativeTarget(base.model, base.layer_ids, max_slots=4, max_len=base.max_len, static=static)
    drafter = None
    if speculative:
        drafter = DFlashDrafter(models.engine.drafter.draft, target, max_slots=4, max_len=base.max_len,
                                static=StaticShapes(batch_sizes=(1, 2, 4), compiled=False),
                                pending_blocks=1)  # a GPU's: a proposal never writes held-back rows beforehand
    return Engine(target, drafter, eos_token_ids=models.engine.eos_token_ids, speculation="fixed",
                  grammar=models.engine.grammar)


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
def test_a_decode_step_copies_once_per_forward_and_waits_only_for_results(speculative: bool) -> None:
    engine = _engine(speculative)
    ids = [engine.add_request(prompts()[i % 3], SamplingParams(max_tokens=24, ignore_eos=True, **kw))
           for i, kw in enumerate(CASES.values())]
    seen = []
    while engine.has_unfinished():
        decoding = bool(engine.scheduler.running) and not engine.num_waiting() and not engine.scheduler.prefilling
        with count_transfers() as counts, uncounted_copies(every_to=False) as copies:
            engine.step()
        if decoding:  # a prefill forward (eager, ragged prompts) is not a decode step
            seen.append((counts.h2d, counts.d2h))
            assert copies == [], copies
    # per step at most: the draft's inputs, the target's, the sampling controls' (sampled, penalised, grammar
    # rows); waits: the draft's proposals (with their confidences) and the target's choices of every row
    most = (3, 2) if speculative else (2, 1)
    assert len(seen) >= 5 and all(h2d <= most[0] and d2h <= most[1] for h2d, d2h in seen), seen
    assert seen.count(most) >= 5, seen  # while every kind of request runs, exactly that
    assert all(engine.stats(i).generated_tokens == 24 for i in ids[:3])
