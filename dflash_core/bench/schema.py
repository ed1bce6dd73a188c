"""The JSON that `dflash-bench offline` and `dflash-bench serve` write: `BENCH_SCHEMA` and its check.

The package docstring (`help(dflash_core.bench)`) says how every figure is measured.
"""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 2  # 2: serve levels run in rounds (repeats, rounds, spread; config repeats, min_duration_s)

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT = {"type": "integer", "minimum": 0}
_STR_OR_NULL = {"type": ["string", "null"]}
_DIST = {
    "type": "object",
    "description": "mean and percentiles of a quantity in seconds (null without samples)",
    "required": ["mean", "p50", "p90", "p99"],
    "properties": {k: _NUM_OR_NULL for k in ("mean", "p50", "p90", "p99")},
    "additionalProperties": False,
}
_SPREAD = {
    "type": "object",
    "description": "spread of a per-round figure over a level's rounds (stdev: sample, null under 2 rounds)",
    "required": ["min", "max", "stdev"],
    "properties": {"min": _NUM, "max": _NUM, "stdev": _NUM_OR_NULL},
    "additionalProperties": False,
}
_ROUND = {
    "type": "object",
    "description": "one round of a level: its requests sent together (at most `concurrency` in flight)",
    "required": ["duration_s", "completed", "failed", "output_tokens", "output_tokens_per_s", "request_throughput"],
    "properties": {
        "duration_s": _NUM,
        "completed": {"type": "integer", "minimum": 0},
        "failed": {"type": "integer", "minimum": 0},
        "output_tokens": {"type": "integer", "minimum": 0},
        "output_tokens_per_s": _NUM,
        "request_throughput": _NUM,
    },
    "additionalProperties": False,
}
_COMMON = {
    "schema_version": {"const": SCHEMA_VERSION},
    "created": {"type": "string", "description": "UTC time, ISO 8601"},
    "command": {"type": "string", "description": "the command line that produced the file"},
    "environment": {
        "type": "object",
        "required": ["python", "platform", "cpu", "cpu_count", "torch", "dflash_serve"],
        "properties": {
            "python": {"type": "string"},
            "platform": {"type": "string"},
            "cpu": {"type": "string"},
            "cpu_count": {"type": ["integer", "null"]},
            "torch": _STR_OR_NULL,
            "torch_threads": {"type": ["integer", "null"]},
            "gpu": _STR_OR_NULL,
            "omp_wait_policy": _STR_OR_NULL,
            "dflash_serve": {"type": "string"},
        },
    },
}
_RUN = {
    "type": "object",
    "description": "one request of one prompt on one engine",
    "required": ["output_tokens", "time_s", "ttft_s", "decode_tokens_per_s", "finish_reason"],
    "properties": {
        "output_tokens": _INT,
        "time_s": _NUM,
        "ttft_s": _NUM,
        "decode_tokens_per_s": _NUM_OR_NULL,
        "finish_reason": {"type": "string"},
        "num_drafts": _INT,
        "num_accepted_tokens": _INT,
        "mean_acceptance_length": _NUM,
        "acceptance_lengths": {"type": "array", "items": {"type": "integer", "minimum": 1}},
    },
}
_ENGINE_SUMMARY = {
    "type": "object",
    "required": ["output_tokens", "total_time_s", "output_tokens_per_s", "decode_tokens_per_s", "ttft_s"],
    "properties": {
        "output_tokens": _INT,
        "total_time_s": _NUM,
        "output_tokens_per_s": _NUM,
        "decode_tokens_per_s": _NUM_OR_NULL,
        "ttft_s": _DIST,
    },
}
OFFLINE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version",
        "mode",
        "created",
        "command",
        "environment",
        "config",
        "summary",
        "prompts",
    ],
    "properties": {
        **_COMMON,
        "mode": {"const": "offline"},
        "config": {
            "type": "object",
            "required": [
                "target",
                "draft",
                "dataset",
                "num_prompts",
                "max_tokens",
                "block_size",
                "device",
                "dtype",
                "temperature",
                "top_p",
                "top_k",
                "seed",
            ],
            "properties": {
                "target": {"type": "string"},
                "draft": {"type": "string"},
                "tokenizer": _STR_OR_NULL,
                "dataset": {"type": "string"},
                "num_prompts": _INT,
                "max_tokens": {"type": "integer", "minimum": 1},
                "block_size": {"type": "integer", "minimum": 2},
                "device": {"type": "string"},
                "dtype": {"type": "string"},
                "backend": {"type": "string"},
                "temperature": _NUM,
                "top_p": _NUM,
                "top_k": {"type": "integer"},
                "seed": {"type": "integer"},
                "load_time_s": _NUM,
            },
        },
        "summary": {
            "type": "object",
            "required": [
                "num_prompts",
                "block_size",
                "plain",
                "dflash",
                "speedup",
                "mean_prompt_speedup",
                "decode_speedup",
                "mean_acceptance_length",
                "mean_acceptance_length_per_prompt",
                "acceptance_histogram",
                "identity_checked",
                "identical_outputs",
            ],
            "properties": {
                "num_prompts": _INT,
                "block_size": {"type": "integer", "minimum": 2},
                "plain": _ENGINE_SUMMARY,
                "dflash": _ENGINE_SUMMARY,
                "speedup": _NUM,
                "mean_prompt_speedup": _NUM,
                "decode_speedup": _NUM_OR_NULL,
                "estimated_speedup": {
                    **_NUM_OR_NULL,
                    "description": "the engine's own estimate of its decode speedup over plain steps "
                    "(dflash_spec_decode_estimated_speedup), from its measured step costs",
                },
                "mean_acceptance_length": _NUM,
                "mean_acceptance_length_per_prompt": _NUM,
                "acceptance_histogram": {
                    "type": "object",
                    "description": "index k counts draft/verify steps that committed k + 1 tokens (1..B)",
                    "required": ["counts", "fractions"],
                    "properties": {
                        "counts": {"type": "array", "items": _INT},
                        "fractions": {"type": "array", "items": _NUM},
                    },
                },
                "identity_checked": {"type": "boolean", "description": "greedy: outputs had to be identical"},
                "identical_outputs": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "prompts with equal output",
                },
            },
        },
        "prompts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "source", "prompt_tokens", "plain", "dflash", "speedup", "identical"],
                "properties": {
                    "index": _INT,
                    "source": {"type": "string"},
                    "prompt_tokens": _INT,
                    "plain": _RUN,
                    "dflash": _RUN,
                    "speedup": _NUM,
                    "identical": {"type": "boolean"},
                },
            },
        },
    },
}
_LEVEL = {
    "type": "object",
    "required": [
        "concurrency",
        "repeats",
        "num_requests",
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_tokens",
        "output_tokens_per_s",
        "ttft_s",
        "itl_s",
        "tpot_s",
        "e2e_latency_s",
        "mean_acceptance_length",
        "dflash",
        "errors",
        "spread",
        "rounds",
    ],
    "properties": {
        "outputs": {"type": "object", "description": "request index -> its text (the same in every round)"},
        "concurrency": {"type": "integer", "minimum": 1},
        "repeats": {"type": "integer", "minimum": 1, "description": "rounds run at this level"},
        "num_requests": _INT,
        "completed": _INT,
        "failed": _INT,
        "duration_s": _NUM,
        "request_throughput": _NUM,
        "output_tokens": _INT,
        "output_tokens_per_s": _NUM,
        "ttft_s": _DIST,
        "itl_s": _DIST,
        "tpot_s": _DIST,
        "e2e_latency_s": _DIST,
        "mean_acceptance_length": _NUM_OR_NULL,
        "dflash": {
            "type": ["object", "null"],
            "description": "sums of the servers' per-request dflash fields; null when it sends none",
            "required": ["num_drafts", "num_draft_tokens", "num_accepted_tokens"],
            "properties": {k: _INT for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        },
        "errors": {"type": "array", "items": {"type": "string"}, "description": "the first few failures"},
        "spread": {
            "type": "object",
            "description": "run-to-run spread of the level's throughput over its rounds",
            "required": ["output_tokens_per_s", "request_throughput"],
            "properties": {"output_tokens_per_s": _SPREAD, "request_throughput": _SPREAD},
        },
        "rounds": {"type": "array", "items": _ROUND, "minItems": 1},
    },
}
SERVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version",
        "mode",
        "created",
        "command",
        "environment",
        "label",
        "config",
        "server",
        "levels",
        "comparison",
    ],
    "properties": {
        **_COMMON,
        "mode": {"const": "serve"},
        "label": {"type": "string"},
        "config": {
            "type": "object",
            "required": [
                "base_url",
                "model",
                "dataset",
                "max_tokens",
                "temperature",
                "concurrency",
                "repeats",
                "min_duration_s",
            ],
            "properties": {
                "base_url": {"type": "string"},
                "model": {"type": "string"},
                "dataset": {"type": "string"},
                "max_tokens": {"type": "integer", "minimum": 1},
                "temperature": _NUM,
                "top_p": _NUM,
                "seed": {"type": "integer"},
                "concurrency": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                "num_prompts": {"type": ["integer", "null"]},
                "repeats": {"type": "integer", "minimum": 1, "description": "least rounds per level"},
                "min_duration_s": {"type": "number", "minimum": 0, "description": "least seconds per level"},
            },
        },
        "server": {"type": "object", "description": "the model entry of /v1/models, as the server sent it"},
        "levels": {"type": "array", "items": _LEVEL},
        "comparison": {
            "type": ["object", "null"],
            "required": ["baseline_label", "baseline_file", "levels"],
            "properties": {
                "baseline_label": {"type": "string"},
                "baseline_file": {"type": "string"},
                "levels": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": [
                            "concurrency",
                            "output_throughput_speedup",
                            "request_throughput_speedup",
                            "ttft_p50_ratio",
                            "itl_p50_ratio",
                            "tpot_p50_ratio",
                        ],
                        "properties": {
                            "concurrency": {"type": "integer"},
                            "output_throughput_speedup": _NUM_OR_NULL,
                            "request_throughput_speedup": _NUM_OR_NULL,
                            "ttft_p50_ratio": _NUM_OR_NULL,
                            "itl_p50_ratio": _NUM_OR_NULL,
                            "tpot_p50_ratio": _NUM_OR_NULL,
                            "identical_outputs": {
                                **_INT, "description": "side-by-side sweeps: requests whose text equals the "
                                "baseline's (greedy: all of them)",
                            },
                            "compared_outputs": _INT,
                        },
                    },
                },
            },
        },
    },
}
BENCH_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dflash-bench result",
    "description": "The JSON written by `dflash-bench offline` or `dflash-bench serve` (the module "
    "docstring says how every figure is measured). Ratios: *_speedup = baseline time / this time (or "
    "this throughput / baseline throughput), > 1 is faster; *_ratio = this latency / baseline latency.",
    "oneOf": [OFFLINE_SCHEMA, SERVE_SCHEMA],
}


def validate(result: dict[str, Any]) -> None:
    """Check a result against BENCH_SCHEMA (when jsonschema is installed)."""
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(result, BENCH_SCHEMA)
