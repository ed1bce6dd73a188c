#!/usr/bin/env python3
"""Plant known bugs one at a time in a copy of the repo and check that the test suite catches each.

Every entry names a file, the function it lands in, one or more exact (original -> mutated) replacements and the
tests that should fail. The original text must occur exactly once in the file: when the code moves on, the entry
is reported as STALE and the check fails, so the list stays in step with the code. A mutation that no longer
compiles is reported as INVALID (it would be "caught" for the wrong reason).

    python scripts/mutation_check.py              # all entries, two at a time
    python scripts/mutation_check.py --list       # the entries
    python scripts/mutation_check.py -k top_p     # entries whose name contains "top_p"
    python scripts/mutation_check.py -k api_key -k logprobs   # either

Exit 0 when every planted bug made some test fail; 1 when one survived; 2 when an entry is stale or invalid.
Runs in about 5-8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".venv", ".git", "__pycache__", "bench-results", "*.egg-info", ".pytest_cache",
                                     ".ruff_cache")
TEST_TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutation:
    """One planted bug: exact replacements in one file, and the tests that must notice."""

    name: str
    file: str
    function: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


SAMPLING = "tests/test_sampling_reference.py"
DRAFT_REF = "tests/test_draft_reference.py"
DRAFT_FAULT = f"{DRAFT_REF}::test_failed_draft_forward_consumes_nothing"
MATRIX = "tests/test_backends_matrix.py"
ENGINE = "tests/test_engine.py"
ACCEPT = "dflash_core/engine.py"
DRAFTER = "dflash_core/runners/drafter.py"
FUSED_C = "dflash_core/cpu_step/fused_step.c"  # built by the tests that import it; a build error fails them
CPU_STEP = "tests/test_cpu_step.py"


def m(name: str, file: str, function: str, original: str, mutated: str, *tests: str) -> Mutation:
    """A one-replacement entry."""
    return Mutation(name, file, function, ((original, mutated),), tests)


MUTATIONS: tuple[Mutation, ...] = (
    # sampling: the processed distribution and the position-keyed draws
    m("top_p_inclusive_cumsum", "dflash_core/sampling.py", "processed_probs",
      "keep = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p",
      "keep = sorted_probs.cumsum(-1) < params.top_p", SAMPLING),
    m("top_p_less_or_equal", "dflash_core/sampling.py", "processed_probs",
      "keep = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p",
      "keep = (sorted_probs.cumsum(-1) - sorted_probs) <= params.top_p", SAMPLING),
    m("top_k_ignored", "dflash_core/sampling.py", "processed_probs",
      "if 0 < params.top_k < vocab:", "if 0 < params.top_k < 1:", SAMPLING),
    m("draws_keyed_one_position_late", "dflash_core/sampling.py", "choose_token_tensor",
      "positions = torch.arange(first_position, first_position + n, device=probs.device, dtype=torch.int64)",
      "positions = torch.arange(first_position + 1, first_position + 1 + n, device=probs.device, dtype=torch.int64)",
      SAMPLING),
    m("draws_keyed_by_position_only", "dflash_core/sampling.py", "_uniforms",
      "h = _mix_(keys + tokens)", "h = _mix_(keys + tokens * 0)", SAMPLING),
    m("device_draws_differ_from_host", "dflash_core/sampling.py", "_shr",
      "return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)", "return z >> bits",
      "tests/test_speculation.py::test_token_uniforms_on_the_device_equal_the_host_draws"),
    m("verify_draws_wrong_position", "dflash_core/verify.py", "step_choices",
      "out.logits, req.params, req.seed, req.position + 1, req.processor",
      "out.logits, req.params, req.seed, req.position, req.processor", SAMPLING),
    m("tiny_temperature_not_greedy", "dflash_core/sampling.py", "SamplingParams.greedy",
      "return self.temperature < SAMPLING_EPS", "return self.temperature == 0.0", SAMPLING, ENGINE),
    m("no_nan_guard", "dflash_core/sampling.py", "processed_probs",
      "return torch.where(bad, onehot, probs)", "return probs", SAMPLING),
    # acceptance
    m("biased_acceptance_half_strength", "dflash_core/tree.py", "DraftTree.path",
      "while (child := self.children[node].get(chosen[node])) is not None:",
      "while (child := self.children[node].get(chosen[node], next(iter(self.children[node].values()), None)"
      " if float(torch.rand(())) < 0.5 else None)) is not None:", SAMPLING),
    m("crop_keeps_rejected_token", ACCEPT, "Engine._accept",
      "self.target.crop(req.cache, p + accepted + 1)", "self.target.crop(req.cache, p + accepted + 2)", MATRIX),
    m("bonus_token_from_draft", ACCEPT, "Engine._accept",
      "[chosen[path[-1]]]", "[(tree.tokens + chosen[-1:])[path[-1] + 1]]", MATRIX),
    # the draft's context: which rows, which layer
    m("rejected_features_in_context", ACCEPT, "Engine._accept",
      "out.features[: accepted + 1] if tree.is_chain", "out.features if tree.is_chain",
      DRAFT_REF, "tests/test_demo_quality.py::test_engine_acceptance_guard"),
    m("hf_feature_one_layer_off", "dflash_core/runners/hf.py", "HFTarget.forward",
      "out.hidden_states[i + 1][0]", "out.hidden_states[i][0]", DRAFT_REF),
    m("native_feature_one_layer_off", "dflash_core/runners/native.py", "NativeTarget._trunk",
      "hidden_ids = [i + 1 for i in self.layer_ids] if features else []",
      "hidden_ids = [i for i in self.layer_ids] if features else []", DRAFT_REF),
    # failures confined to their request
    m("verify_retry_without_crop", ACCEPT, "Engine._forward_rows",
      "self.target.crop(cache, start)", "self.target.crop(cache, start + len(tokens))", ENGINE),
    m("hf_crop_one_length_for_all_layers", "dflash_core/runners/hf.py", "HFTarget.crop",
      'layers = getattr(cache, "layers", None)', "layers = None", ENGINE),
    m("draft_pending_cleared_before_forward", DRAFTER, "DFlashDrafter.propose_scored",
      "pending = [torch.cat(st.pending, dim=0) if st.pending else None for st, *_ in items]",
      "pending = [(torch.cat(st.pending, dim=0), st.pending.clear())[0] if st.pending else None "
      "for st, *_ in items]", DRAFT_FAULT),
    m("draft_cache_not_rolled_back", DRAFTER, "DFlashDrafter.propose_scored",
      "cache.length = rollback", "cache.length = cache.length", DRAFT_FAULT),
    # hybrid targets: the recurrent state rolled back to the accepted prefix, padded rows frozen
    m("hybrid_rollback_one_token_short", "dflash_core/runners/hybrid.py", "HybridTarget._restore",
      "for i in range(keep):", "for i in range(keep - 1):", "tests/test_hybrid.py", MATRIX),
    m("hybrid_padding_updates_state", "dflash_core/runners/hybrid.py", "HybridTarget._recurrent",
      "state = torch.where(active[:, i, None, None, None], new, state)", "state = new",
      "tests/test_hybrid.py::test_rows_of_different_widths_in_one_batch_stay_exact"),
    # draft formats: the window ring's positions, a reduced vocabulary's id map, RoPE attention scaling
    # the draft's context written per prefill chunk: at the positions that follow what is already written
    m("draft_context_written_a_row_late", "dflash_core/runners/drafter.py", "DFlashDrafter._write_context",
      "table_rows(state.blocks, self.kv_block, start, start + n)",
      "table_rows(state.blocks, self.kv_block, start + 1, start + n + 1)",
      "tests/test_draft_context.py"),
    m("draft_window_key_positions_wrong", "dflash_core/draft_cache.py", "PagedBatch.key_positions",
      "return self.base[:, None] * self.cache.kv_block + pos[None]", "return pos.expand(batch, n)",
      "tests/test_draft_window.py"),
    m("reduced_vocab_ids_not_mapped", "dflash_core/draft.py", "DFlashDraft.target_ids",
      "return ids if self.d2t is None else ids + self.d2t[ids]", "return ids", "tests/test_speculators.py"),
    m("rope_attention_scaling_dropped", "dflash_core/draft.py", "DFlashDraft.rope",
      "if self._rope_scaling != 1.0:", "if False:", "tests/test_draft_rope.py"),
    # the slot pool: one slot per running request, shared by its target and draft caches
    m("slot_never_returned", "dflash_core/slots.py", "SlotPool.release",
      "        self._free.append(slot)\n", "\n", "tests/test_native.py", "tests/test_llm.py"),
    m("prefix_hit_not_in_the_cache", "dflash_core/kv/requests.py", "RequestMemory.start",
      "self.target.new_cache(kv.slot, kv.blocks, kv.cached, state=kv.state)",
      "self.target.new_cache(kv.slot, kv.blocks, 0, state=kv.state)",
      "tests/test_prefix_cache.py::test_each_turn_prefills_only_its_new_tokens"),
    m("preempted_request_resumes_one_token_off", "dflash_core/kv/requests.py", "RequestMemory.preempt",
      "req.prefill_tokens = (req.prompt + req.output)[: req.position]",
      "req.prefill_tokens = (req.prompt + req.output)[: req.position + 1]", "tests/test_prefix_cache.py"),
    # the scheduler and the width policy: chunked prefill, ragged rows, widths within the proposals
    m("prefill_chunk_skips_a_token", "dflash_core/scheduler.py", "Scheduler._chunk",
      "plan.prefill.append(Chunk(r, r.prefilled, r.prefill_tokens[r.prefilled : r.prefilled + n]))",
      "plan.prefill.append(Chunk(r, r.prefilled, r.prefill_tokens[r.prefilled + 1 : r.prefilled + n]))", MATRIX),
    m("ragged_columns_of_the_first_row", "dflash_core/runners/paged.py", "PagedTarget._flat",
      "col_of = torch.arange(sum(len(t) for t, _, _ in rows), device=self.device) - starts[row_of]",
      "col_of = torch.arange(sum(len(t) for t, _, _ in rows), device=self.device) - (starts + g.lengths)[row_of]"
      " + g.lengths[0]",
      "tests/test_native.py::test_batched_rows_equal_single_rows"),
    m("ragged_widths_over_budget", "dflash_core/speculation.py", "WidthPolicy.widths",
      "if nxt is None or verified + nxt - keep[r] > limit:", "if nxt is None:",
      "tests/test_speculation.py::test_ragged_rows_get_their_own_widths_within_the_budget"),
    m("penalty_counts_without_the_draft_prefix", "dflash_core/processors.py", "Penalties.apply",
      "counts = counts + steps.cumsum(dim=0)", "counts = counts + steps.cumsum(dim=0) * 0",
      "tests/test_processors.py"),
    m("grammar_does_not_cut_the_proposal", "dflash_core/verify.py", "grammar_cut",
      "return proposals[: req.grammar.walk(proposals)]", "return proposals", "tests/test_grammar.py"),
    # DFlash 2: the convolution and the candidate selector
    m("dflash2_conv_without_the_previous_row", "dflash_core/dflash2.py", "GroupedDynamicConv._conv",
      "out = out + kernel[:, :, t] * F.pad(x, (0, 0, t, 0))[:, :q]", "out = out + kernel[:, :, t] * x",
      "tests/test_dflash2.py"),
    m("dflash2_selector_ignores_the_predecessor", "dflash_core/dflash2.py", "CandidateSelector.walk",
      "scores = unary[:, pos] + self._pair(hp[:, pos], tokens[-1], cand[:, pos])",
      "scores = unary[:, pos] + 0 * self._pair(hp[:, pos], tokens[-1], cand[:, pos])", "tests/test_dflash2.py"),
    # rejection sampling (--spec-sampling rejection)
    m("rejection_residual_is_the_target_law", "dflash_core/rejection.py", "rejection_choices",
      "residual = (probs - dist.to(probs.dtype)).clamp_min_(0.0)", "residual = probs.clone()",
      "tests/test_rejection.py"),
    m("rejection_accepts_twice_the_ratio", "dflash_core/rejection.py", "rejection_choices",
      "accept = u * q_x.double() < p_x.double()", "accept = u * q_x.double() < 2 * p_x.double()",
      "tests/test_rejection.py"),
    m("sampled_confidence_of_the_drawn_token", "dflash_core/draft_sampling.py", "sample_dense",
      "q.amax(dim=-1).view(b, w - 1)", "q.gather(1, drawn.view(-1, 1)).view(b, w - 1)", "tests/test_rejection.py"),
    m("selector_draws_ignore_the_predecessor", "dflash_core/dflash2.py", "CandidateSelector.sample_walk",
      "q = rows.processed(unary[:, pos] + self._pair(hp[:, pos], tokens[-1], cand[:, pos]))",
      "q = rows.processed(unary[:, pos])", "tests/test_rejection.py"),
    # tree verification
    m("tree_rows_preempt_for_their_blocks", "dflash_core/kv/requests.py", "RequestMemory.make_room",
      "while req.kv is not None and not self.kv.grow(req.kv, req.position + self.width):",
      "while req.kv is not None and not self.kv.grow(req.kv, req.position + max(self.width, self.tree_width)):",
      "tests/test_tree.py::test_a_tree_takes_free_blocks_only"),
    m("tree_nodes_see_their_siblings", "dflash_core/tree.py", "tree_mask",
      "return mask & ((rel < 0)[:, None, :] | seen)[:, None]", "return mask", "tests/test_tree.py"),
    m("tree_rows_keep_the_chain_positions", "dflash_core/runners/native.py", "NativeTarget.forward_tree",
      "batch.pos = batch.pos[:, :1] + depth", "batch.pos = batch.pos", "tests/test_tree.py"),
    m("tree_accepted_rows_not_moved", "dflash_core/runners/native.py", "NativeTarget.compact",
      "        if moved:\n", "        if False:\n", "tests/test_tree.py"),
    m("tree_draft_context_of_the_chain_rows", ACCEPT, "Engine._accept",
      "else out.features[path]", "else out.features[: accepted + 1]", "tests/test_tree.py"),
    m("tree_draws_keyed_by_row", "dflash_core/verify.py", "step_choices",
      "positions=None if tree.is_chain else [req.position + 1 + d for d in tree.depths]", "positions=None",
      "tests/test_tree.py"),
    # replacing the draft while serving
    m("swap_keeps_the_old_drafts_weights", DRAFTER, "DFlashDrafter.replace_draft",
      "tensor.copy_(new[name])", "pass", "tests/test_draft_swap.py"),
    m("swap_keeps_the_prefix_cache", "dflash_core/kv/requests.py", "RequestMemory.recompute_all",
      "self.kv.pool.reset_prefix_cache()", "pass", "tests/test_draft_swap.py"),
    # training and the server
    m("train_zero_gradients", "dflash_core/train/loop.py", "train",
      "        loss.backward()\n", "        (loss * 0).backward()\n", "tests/test_train_learns.py"),
    m("stop_string_cut_one_token_late", "dflash_core/detokenize.py", "RequestDecoder.feed",
      "res.tokens_used = i + 1", "res.tokens_used = i + 2",
      "tests/test_demo_quality.py::test_stop_string_inside_a_multi_token_step"),
    m("detok_python_path_emits_split_chars", "dflash_core/detokenize.py", "IncrementalDetokenizer._advance",
      "(len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR))",
      "len(new_text) <= len(prefix_text)", "tests/test_detokenize.py"),
    m("served_weights_keep_the_linear_layout", "dflash_core/weight_layout.py", "stores_input_major",
      'return device.type == "cpu" and dtype == torch.float32', "return False", "tests/test_weight_layout.py"),
    m("packing_loses_the_input_major_layout", "dflash_core/layers.py", "pack_linears",
      "packed = torch.cat([w.t() for w in weights], dim=1).t()", "packed = torch.cat(weights)",
      "tests/test_weight_layout.py"),
    m("fp8_scales_ignored", "dflash_core/quant/fp8.py", "dequantize_blocks",
      "(w[:, : full * b1].view(rows, full, b1) * scale[:, :full, None])", "(w[:, : full * b1].view(rows, full, b1))",
      "tests/test_quant.py"),
    m("quantized_projections_packed_as_linears", "dflash_core/runners/dense.py", "dense_layer",
      'isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj"', 'hasattr(attn, n) for n in ("q_proj"',
      "tests/test_quant.py"),
    m("fp8_load_time_quantization_off", "dflash_core/quant/loader.py", "DFlashQuantizer.param_needs_quantization",
      'return name == "weight" and isinstance(model.get_submodule(owner), (Fp8Linear, GptqLinear))', "return False",
      "tests/test_quant.py"),
    m("kernel_used_without_agreeing", "dflash_core/quant/base.py", "choose_kernel",
      "if not error < kernel.tolerance:", "if False:", "tests/test_quant.py"),
    m("packed_int_offset_dropped", "dflash_core/quant/packed_int.py", "unpack_int32",
      "(unpack_uint(packed, bits, columns).to(torch.int16) - (1 << (bits - 1)))",
      "(unpack_uint(packed, bits, columns).to(torch.int16))", "tests/test_quant.py"),
    m("gptq_zero_offset_ignored", "dflash_core/quant/gptq_awq.py", "GptqLinear._zero_words",
      "        if not self.zero_offset:", "        if True:", "tests/test_quant_gptq_awq.py"),
    m("gptq_v1_offset_without_borrows", "dflash_core/quant/gptq_awq.py", "GptqLinear._codes",
      "return codes, unpack_uint(self._zero_words(), self.bits, self.out_features)",
      "return codes, unpack_uint(self.qzeros, self.bits, self.out_features).to(torch.int16) + self.zero_offset",
      "tests/test_quant_gptq_awq.py"),
    m("gptq_act_order_ignored", "dflash_core/quant/gptq_awq.py", "GptqLinear.dequantized",
      "return _dequantize(codes, zeros, self.scales, self.g_idx.long(), self.compute_dtype)",
      "return _dequantize(codes, zeros, self.scales, torch.arange(self.in_features) // self.group, self.compute_dtype)",
      "tests/test_quant_gptq_awq.py"),
    m("int8_inputs_left_in_full_precision", "dflash_core/quant/int8_channel.py", "Int8ChannelLinear.activations",
      "return fake_quantize_int8_tokens(x) if self.dynamic_activations else x", "return x", "tests/test_quant.py"),
    m("int8_kernel_padding_kept", "dflash_core/quant/int8_channel.py", "Int8Kernel.prepare",
      "torch._int_mm(q.to(torch.int8), weight_t)[:rows]", "torch._int_mm(q.to(torch.int8), weight_t)",
      "tests/test_quant.py"),
    m("int4_kernel_zero_point_sign", "dflash_core/quant/int4_kernel.py", "tinygemm_operands",
      "zero = (8 - zeros.float()) * scale", "zero = (zeros.float() - 8) * scale", "tests/test_quant_gptq_awq.py"),
    m("mxfp4_router_weights_ignored", "dflash_core/quant/mxfp4.py", "Mxfp4Experts.forward",
      "(y * routing_weights[tokens, slot, None])", "y", "tests/test_quant_mxfp4.py"),
    m("mxfp4_stray_tensors_accepted", "dflash_core/quant/loader.py", "DFlashQuantizer._swap_experts",
      "        if held:", "        if False:", "tests/test_quant_mxfp4.py"),
    m("awq_interleave_not_undone", "dflash_core/quant/gptq_awq.py", "AwqLinear._unpack",
      "[:, :, list(AWQ_UNDO)]", "", "tests/test_quant_gptq_awq.py"),
    m("fp8_dynamic_inputs_left_in_full_precision", "dflash_core/quant/fp8_channel.py",
      "Fp8ChannelLinear.activations", "return fake_quantize_tokens(x) if self.dynamic_activations else x", "return x",
      "tests/test_quant.py"),
    m("fp8_weights_without_scales_accepted", "dflash_core/quant/loader.py", "load_quantized",
      "        if unscaled:", "        if False:", "tests/test_quant.py"),
    m("api_key_prefix_accepted", "server/checks.py", "check_auth",
      "not hmac.compare_digest(token.strip().encode(), api_key.encode())", "not api_key.startswith(token.strip())",
      "tests/test_api_key.py"),
    m("fused_attention_misses_its_own_key", FUSED_C, "layer_forward",
      "b->pos[t] + 1, NULL, 0, W", "b->pos[t], NULL, 0, W",
      f"{CPU_STEP}::test_fused_forward_matches_the_pytorch_forward"),
    m("fused_gemm_chains_restart_per_block_of_k", FUSED_C, "gemm", "int first = k0 == 0;", "int first = 1;",
      f"{CPU_STEP}::test_fused_forward_matches_the_pytorch_forward"),
    m("held_events_overtaken_by_a_direct_post", "server/worker.py", "Worker._post",
      "            run_held()\n            self._poster", "            self._poster",
      "tests/test_worker_fake.py::test_an_event_posted_between_steps_comes_after_the_tokens_of_the_step_before"),
    m("draft_swap_runs_before_held_events", "server/worker.py", "Worker._iteration",
      "                run_held()  # a call (a draft swap)", "                pass  # a call (a draft swap)",
      "tests/test_worker_fake.py::test_a_call_between_steps_runs_after_the_last_steps_events_are_posted"),
    m("eager_prefill_runs_before_held_work", "dflash_core/runners/native.py", "NativeTarget._eager",
      "            run_held()\n        b, n = batch.b, batch.n", "            pass\n        b, n = batch.b, batch.n",
      "tests/test_overlap.py"),
    m("held_work_waits_past_the_fused_call", "dflash_core/cpu_step/fused.py", "FusedCpuStep.run_kernel",
      "        run_held()\n        if self._lib.dflash_forward(", "        if self._lib.dflash_forward(",
      "tests/test_overlap.py"),
    m("plain_twin_shares_prefix_with_dflash", "dflash_core/kv/requests.py", "RequestMemory.__init__",
      "self.root = prefix_root(drafter is not None)", "self.root = prefix_root(True)",
      "tests/test_prefix_cache.py::test_an_engine_without_a_draft_shares_no_prefix_with_one"),
    m("huge_top_k_packed_as_is", "dflash_core/sampling.py", "choose_step", "min(p.top_k, TOP_K_ALL)", "p.top_k",
      "tests/test_engine.py::test_a_top_k_past_the_vocabulary_keeps_every_token"),
    m("batched_choice_failure_fails_the_step", "dflash_core/verify.py", "step_choices",
      "        return [_alone(block) for block in blocks]", "        raise",
      "tests/test_engine.py::test_a_request_that_breaks_the_batched_choice_fails_alone"),
    m("long_max_model_len_accepted", "dflash_core/loading.py", "check_max_model_len",
      "max_model_len <= model_max or", "True or",
      "tests/test_memory_budget.py::test_a_length_past_the_models_positions_is_refused"),
    m("forced_tool_choice_content_empty_string", "server/formatters.py", "ChatFormatter._final_choice",
      "parts.reasoning or self.plan.forced_tools:", "parts.reasoning:",
      "tests/test_tool_choice_e2e.py::test_a_forced_choice_cut_before_its_first_name_has_null_content"),
    m("min_tokens_bans_the_grammars_end", "dflash_core/processors.py", "MinTokens._banned_rows",
      "return i  # only the grammar's end is left", "continue  # only the grammar's end is left",
      "tests/test_grammar_failures.py::test_the_grammars_end_wins_over_min_tokens"),
    m("grammar_dead_end_is_a_500", "dflash_core/outputs.py", "failed_output",
      "    if isinstance(exc, GrammarFailure):", "    if False:",
      "tests/test_grammar_failures.py::test_a_grammar_that_cannot_go_on_is_a_400_or_an_error_event_that_says_so"),
    m("client_gone_mid_body_is_a_traceback", "server/errors.py", "install_error_handlers",
      "    @app.exception_handler(ClientDisconnect)\n", "",
      "tests/test_http_robustness.py::test_a_client_that_leaves_mid_body_is_one_info_line"),
    m("trees_priced_as_chains", "dflash_core/speculation.py", "WidthPolicy.tree_sizes",
      "max(spent + self.costs.tree(grown), 1e-9)", "max(spent + self.costs.target(grown), 1e-9)",
      "tests/test_tree.py::test_the_adaptive_policy_weighs_the_tree_against_the_chain"),
    m("tree_forwards_timed_as_chains", "dflash_core/engine.py", "Engine._decode_batch",
      "self.policy.costs.verify_table(not chains).add", "self.policy.costs.target.add",
      "tests/test_tree.py::test_tree_forwards_are_timed_apart_from_chain_forwards"),
    m("retries_priced_at_nothing", "dflash_core/speculation.py", "WidthPolicy.drafting",
      "            if rate(len(chosen) + 1, hoped) < best_rate:\n                break",
      "            if False:\n                break",
      "tests/test_speculation.py::test_no_retries_where_the_step_costs_alone_rule_drafting_out"),
    m("retry_hope_lowered_by_a_bad_run", "dflash_core/speculation.py", "WidthPolicy.drafting",
      "max((self.block_size + 1) / 2, states[i].mean_committed)", "max(self.mean_committed, states[i].mean_committed)",
      "tests/test_speculation.py::test_a_draft_that_did_badly_for_a_while_is_still_retried"),
    m("looking_loop_woken_every_step", "server/handoff.py", "_Mailbox.post",
      "            if self.looking and not wake:", "            if False:",
      "tests/test_handoff.py::test_a_looking_loop_gets_a_steady_stream_without_being_woken_again"),
    m("first_tokens_wait_for_a_poll", "server/worker.py", "Worker._on_output",
      "wake=bool(text) and not r.shown)", "wake=False)",
      "tests/test_handoff.py::test_a_worker_wakes_a_looking_loop_for_a_requests_first_tokens_and_its_end"),
    m("plain_streak_written_block_by_block", "dflash_core/runners/drafter.py", "DFlashDrafter.__init__",
      "CPU_PENDING_BLOCKS if torch.device", "1 if torch.device",
      "tests/test_draft_paged.py::test_a_plain_streak_holds_context_rows_back_on_a_cpu_and_a_proposal_catches_up"),
    m("held_context_never_caught_up", "dflash_core/runners/drafter.py", "DFlashDrafter.catch_up",
      "                self._write_beyond(st, self.block_size)", "                pass",
      "tests/test_draft_paged.py::test_a_plain_streak_holds_context_rows_back_on_a_cpu_and_a_proposal_catches_up"),
    m("held_draft_rows_left_out_of_the_index", "dflash_core/kv/requests.py", "RequestMemory.release",
      "                self.drafter.catch_up([req.draft_state])", "                pass",
      "tests/test_hybrid_prefix.py::test_a_dflash_request_that_ended_on_plain_steps_leaves_its_blocks_in_the_index"),
    m("loop_stops_at_the_first_empty_look", "server/handoff.py", "LookPace.keep_looking",
      "due = 2 * self.gap if", "due = 0 * self.gap if",
      "tests/test_handoff.py::test_a_loop_looks_on_until_twice_the_usual_gap_between_steps_has_passed"),
    m("fused_context_write_a_position_late", "dflash_core/cpu_step/fused_draft.py", "FusedDraftStep.write_context",
      "features.float().contiguous(), list(positions)", "features.float().contiguous(), [p + 1 for p in positions]",
      "tests/test_cpu_step.py::test_fused_context_write_matches_the_pytorch_write"),
    m("continuous_usage_stats_ignored", "server/streaming.py", "stream_body",
      "                if continuous:\n", "                if False:\n",
      "tests/test_openai_surface.py::test_continuous_usage_stats_put_usage_on_every_chunk"),
    m("fused_draft_sees_padding_keys", FUSED_C, "dflash_draft_forward", "b->block_len[r], W,", "w, W,",
      f"{CPU_STEP}::test_fused_draft_proposes_as_the_pytorch_draft"),
    Mutation("logprobs_of_processed_logits", ACCEPT, "Engine._prefilled, Engine._accept", (
        ("commit_tokens(req, token, out.logits, StepOutput(req.id, [], is_prefill=True))",
         "commit_tokens(req, token, self._processed(req, out.logits, []), StepOutput(req.id, [], is_prefill=True))"),
        ("logits = out.logits if tree.is_chain else out.logits[path]",
         "logits = self._processed(req, out.logits, tree.proposals) if tree.is_chain else out.logits[path]"),
    ), ("tests/test_processors.py::test_logprobs_are_the_raw_model_distribution_under_every_control",)),
)


@dataclass
class Result:
    mutation: Mutation
    status: str  # CAUGHT | SURVIVED | STALE | INVALID
    detail: str
    seconds: float


def apply(copy: Path, m: Mutation) -> str | None:
    """Apply ``m`` in ``copy``; None, or why it cannot be applied (stale / invalid)."""
    path = copy / m.file
    text = path.read_text()
    for original, mutated in m.edits:
        count = text.count(original)
        if count != 1:
            return f"STALE: {original!r} occurs {count} times in {m.file} (expected once, in {m.function})"
        text = text.replace(original, mutated)
    path.write_text(text)
    if path.suffix != ".py":
        return None
    try:
        py_compile.compile(str(path), doraise=True)
    except py_compile.PyCompileError as e:
        return f"INVALID: the mutated {m.file} does not compile: {e.msg}"
    return None


def run_one(copy: Path, m: Mutation, python: str) -> Result:
    """Plant ``m`` in ``copy``, run its tests, restore the file."""
    t0 = time.monotonic()
    original = (copy / m.file).read_text()
    try:
        problem = apply(copy, m)
        if problem is not None:
            return Result(m, problem.split(":")[0], problem, time.monotonic() - t0)
        env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("DFLASH_")}
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Result(m, "CAUGHT", f"tests timed out after {TEST_TIMEOUT_S} s", time.monotonic() - t0)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        if proc.returncode == 1:
            return Result(m, "CAUGHT", tail[0], time.monotonic() - t0)
        if proc.returncode == 0:
            return Result(m, "SURVIVED", tail[0], time.monotonic() - t0)
        return Result(m, "INVALID", f"pytest exit {proc.returncode}: {tail[0]}", time.monotonic() - t0)
    finally:
        (copy / m.file).write_text(original)


def make_copy(root: Path, python: str) -> Path:
    """A copy of the working tree whose packages are the ones the tests import."""
    copy = Path(tempfile.mkdtemp(prefix="mut-", dir=root))
    shutil.copytree(REPO, copy, ignore=COPY_IGNORE, dirs_exist_ok=True)
    probe = subprocess.run(
        [python, "-c", "import dflash_core, server; print(dflash_core.__file__); print(server.__file__)"],
        cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True, check=True,
    )
    for line in probe.stdout.split():
        if not Path(line).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"mutation_check: the copy imports {line}, not its own code; cannot check")
    return copy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", action="append", default=[],
                   help="only entries whose name contains this text (repeat: any of them)")
    p.add_argument("--jobs", type=int, default=2, help="mutations checked at once, each in its own copy")
    p.add_argument("--list", action="store_true", help="list the entries and exit")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m.name:36s} {m.file}:{m.function}  -> {' '.join(m.tests)}")
        return 0
    python = sys.executable
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        copies = [make_copy(Path(tmp), python) for _ in range(max(1, min(args.jobs, len(chosen))))]
        free = list(copies)

        def check(m: Mutation) -> Result:
            copy = free.pop()
            try:
                return run_one(copy, m, python)
            finally:
                free.append(copy)

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            results = []
            for r in pool.map(check, chosen):
                results.append(r)
                print(f"{r.status:8s} {r.mutation.name:36s} {r.seconds:6.1f} s  {r.detail}", flush=True)
    caught = sum(r.status == "CAUGHT" for r in results)
    print(f"\n{caught}/{len(results)} planted bugs caught in {time.monotonic() - t0:.0f} s")
    if any(r.status in ("STALE", "INVALID") for r in results):
        return 2
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
