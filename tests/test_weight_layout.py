"""Served weights stored input-major on a CPU: same values, same parameters (ties kept), packed layers input-major,
the same logits as the standard layout, and a swapped-in draft copied into the serving layout."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dflash_core.config import EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.layers import pack_linears
from dflash_core.loading import DEMO_DRAFT, DEMO_TARGET, load_models, load_target
from dflash_core.runners.native import NativeTarget
from dflash_core.weight_layout import input_major, is_input_major, store_input_major, stores_input_major


def test_input_major_keeps_shape_and_values():
    w = torch.randn(6, 4)
    im = input_major(w)
    assert im.shape == w.shape and torch.equal(im, w)
    assert is_input_major(im) and not is_input_major(w)
    assert input_major(im) is im  # already input-major: returned as is
    assert not is_input_major(torch.randn(1, 4))  # one output row: both layouts are the same memory


def test_store_input_major_keeps_ties_and_is_idempotent():
    model = load_target(DEMO_TARGET, torch.device("cpu"), torch.float32)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is embed  # the demo target ties them
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = store_input_major(model)
    assert moved == sum(1 for m in model.modules() if isinstance(m, nn.Linear) and m.weight.shape[0] > 1)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert is_input_major(head)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert store_input_major(model) == 0


def test_packing_keeps_the_layout():
    lins = [nn.Linear(8, n, bias=False) for n in (4, 2, 2)]
    for lin in lins:
        lin.weight.data = input_major(lin.weight.data)
    values = [lin.weight.detach().clone() for lin in lins]
    packed, _ = pack_linears(lins)
    assert is_input_major(packed) and torch.equal(packed, torch.cat(values))
    for lin, v in zip(lins, values):  # each projection a view of the packed tensor, with its own values
        assert torch.equal(lin.weight, v) and lin.weight.untyped_storage().data_ptr() == packed.untyped_storage(
        ).data_ptr()
    standard = [nn.Linear(8, 3, bias=False) for _ in range(2)]
    assert pack_linears(standard)[0].is_contiguous()


def test_served_demo_pair_is_input_major_and_matches_the_standard_layout():
    models = load_models(EngineConfig(device="cpu"), warm_up=False)
    target = models.engine.target
    assert isinstance(target, NativeTarget)
    dense = target.dense[0]
    assert dense is not None
    for w in (dense.qkv, dense.o, dense.gate_up, dense.down, target.lm_head_weight):
        assert is_input_major(w)
    drafter = models.engine.drafter
    assert drafter is not None and is_input_major(drafter.draft.fc.weight)
    # the same forward with the standard layout: the same logits (up to the summation order of another kernel)
    standard_model = load_target(DEMO_TARGET, torch.device("cpu"), torch.float32)
    standard = NativeTarget(standard_model, None, max_slots=1, max_len=64)
    relaid = NativeTarget(copy.deepcopy(standard_model), None, max_slots=1, max_len=64)
    store_input_major(relaid.model)
    relaid = NativeTarget(relaid.model, None, max_slots=1, max_len=64)  # packed after the move, as served
    seq = list(range(3, 40))
    a = standard.forward(seq, 0, standard.new_cache(0), features=False).logits
    b = relaid.forward(seq, 0, relaid.new_cache(0), features=False).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_swapped_in_draft_lands_in_the_serving_layout():
    models = load_models(EngineConfig(device="cpu"), warm_up=False)
    drafter = models.engine.drafter
    assert drafter is not None
    new = DFlashDraft.from_folder(DEMO_DRAFT)  # standard layout, as a trainer saves it
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(0.5)
    drafter.replace_draft(new)
    serving = drafter.draft
    assert is_input_major(serving.fc.weight)
    for (name, p), (_, q) in zip(serving.named_parameters(), new.named_parameters()):
        assert torch.equal(p, q), name


def test_only_float32_on_a_cpu_is_relaid():
    assert stores_input_major(torch.device("cpu"), torch.float32)
    assert not stores_input_major(torch.device("cpu"), torch.bfloat16)
    assert not stores_input_major(torch.device("cuda"), torch.float32)
    models = load_models(EngineConfig(device="cpu", dtype="bfloat16", speculative=False), warm_up=False)
    dense = models.engine.target.dense[0]
    assert dense is not None and dense.qkv.is_contiguous() and not is_input_major(dense.qkv)
