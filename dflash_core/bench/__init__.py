"""dflash-bench: DFlash against plain decoding of the same target, measured side by side.

``dflash-bench offline``
    In-process. Loads the target once and builds two engines on the same target object: plain
    autoregressive decoding (block size 1) and DFlash. Every prompt runs on both, interleaved prompt by
    prompt (plain first on even prompts, DFlash first on odd ones, so slow drift cancels), with the same
    sampling settings and seed, after one warm-up request per engine that is not counted. Greedy (the
    default) must give token-identical outputs: the first difference stops the run with exit code 3, naming
    the prompt and the output position.
    Per request: wall time from ``add_request`` to the last token (``time_s``), time to first token
    (``ttft_s``: the prefill step), decode throughput ``(output_tokens - 1) / (time_s - ttft_s)``, and for
    DFlash the acceptance length of every draft/verify step (``RequestStats.acceptance_lengths``: accepted
    draft tokens + 1, in 1..B). Summary figures:

    - ``speedup``: total plain wall time / total DFlash wall time over the same prompts (prefill included);
    - ``mean_prompt_speedup``: the mean over prompts of the per-prompt ratio;
    - ``decode_speedup``: plain decode time per token / DFlash decode time per token (prefill excluded);
    - ``mean_acceptance_length``: 1 + accepted / drafts over all steps (vLLM's definition; what the
      server's ``dflash`` field and ``/metrics`` report); ``mean_acceptance_length_per_prompt``: the mean of
      per-prompt means (z-lab's benchmark); ``acceptance_histogram``: steps by acceptance length 1..B.

    CPU: torch's thread count unless ``--threads``; ``OMP_WAIT_POLICY=PASSIVE`` unless the environment
    sets it (OpenMP's busy-wait makes small models 10-20x slower on a CPU shared with other processes).

``dflash-bench serve --base-url URL``
    Over the OpenAI API against any OpenAI-compatible server (dflash-serve, vLLM, SGLang): streaming chat
    completions with ``stream_options.include_usage``, a sweep over concurrency levels (a semaphore keeps
    that many requests in flight), one warm-up request first. A level runs in rounds: each round sends the
    level's requests (``--num-prompts``, by default 2 x concurrency, at least 4, at most 32; the same
    requests every round) and waits for all of them. A level runs at least ``--repeats`` rounds (default 3)
    and at least ``--min-duration`` seconds (default 10), so one slow or fast second does not decide it.
    Per level: request throughput, output tokens/s (total tokens / total time of the level's rounds), their
    spread over the rounds (min, max and sample standard deviation of each round's figure), and p50/p90/p99
    of time to first token, inter-token latency, time per output token and end-to-end latency over all the
    level's requests.

    - TTFT: from sending the request to the first chunk with non-empty ``delta.content``.
    - Output tokens: ``usage.completion_tokens`` of the final usage chunk (the number of content chunks
      when the server sends no usage).
    - ITL: a stream chunk can carry several tokens (with DFlash, a whole accepted block) and the API does
      not say how many. A request's ``completion_tokens`` are taken as evenly spread over its content
      chunks: the gap before a chunk divided by the request's mean tokens per chunk is the latency of each
      token the chunk carries. This is exact for servers that stream one token per chunk (plain decoding);
      with DFlash a gap is shared by its block. Percentiles are over all such gaps of a level (every chunk of
      a request counts the same number of tokens). The first chunk's tokens belong to TTFT, not ITL.
      (Sharing tokens out by characters instead was tried: it skews one-token chunks by their length.)
    - TPOT: ``(e2e - ttft) / (completion_tokens - 1)`` per request: exact, no assumption about chunks.
    - Mean acceptance length: ``1 + sum(num_accepted_tokens) / sum(num_drafts)`` over the ``dflash``
      fields of the usage chunks when the server sends them (dflash-serve does; 1.0 with
      ``--no-speculative``), else null.

    ``--compare BASELINE_JSON`` (the JSON of an earlier ``serve`` run, e.g. against dflash-serve
    ``--no-speculative``) prints and records the speedup at each concurrency level.

``dflash-bench memory PRESET.yaml ...``
    The GPU memory of YAML presets on the native backend: weights (target + the draft's own), and the KV block
    pool beside them per card (target and draft pages), in tokens and in requests of ``max_model_len`` and of
    2,048 tokens that run at once, as a Markdown table. Nothing is loaded or downloaded: the presets' models have
    built-in shapes (``MODEL_SHAPES``), local folders are read from their ``config.json``.

Prompt sets: ``chat``, ``math``, ``code`` (32 each, shipped in ``dflash_core/prompts``), ``all`` (the three
interleaved), ``heldout`` (the demo pair's held-out set, ``dflash_core/demo/heldout_prompts.jsonl``), a
JSONL file (``{"messages": [...]}``, ``{"prompt": "..."}`` or ``{"turns": [...]}`` per line), and, through
the ``datasets`` package with network access, ``gsm8k``, ``math500``, ``humaneval``, ``mbpp`` and
``mt-bench`` (first turn), with the prompt formats of z-lab's DFlash benchmark.

Output: a table on the terminal, a JSON file (``BENCH_SCHEMA``) and PNG plots in the output folder:
``--output-dir``, else ``$DFLASH_BENCH_DIR``, else ``./bench-results`` when the current folder is writable,
else ``~/bench-results``, else ``<temp dir>/dflash-bench-results-<uid>`` (an image's root-owned working
folder falls through to the home folder); an output folder named explicitly that cannot be written stops
the run before it starts (exit 2). Files:
``offline.json``, ``offline_speedup.png``, ``offline_acceptance.png``; ``serve_<label>.json``,
``serve_<label>_throughput.png``, ``serve_<label>_latency.png``.

Exit codes: 0 done; 1 a request failed (serve) or the engine failed; 2 bad arguments, an output folder
that cannot be written, a dataset that cannot be loaded, models that cannot be loaded, an unreachable
server or a missing ``bench`` extra (matplotlib, openai: ``pip install "dflash-serve[bench]"``); 3 greedy
DFlash output differs from plain decoding (offline).

Modules: ``prompts`` (prompt sets), ``offline``, ``serve`` and ``memory`` (the three modes), ``measure``
(distributions, the run's environment), ``schema`` (``BENCH_SCHEMA``), ``report`` (tables), ``plots``,
``output`` (output folder, JSON) and ``cli`` (the command line). This package exports what other code uses.
"""

from dflash_core.bench.cli import build_parser, main
from dflash_core.bench.errors import BenchError, IdentityError
from dflash_core.bench.measure import distribution, spread
from dflash_core.bench.memory import format_memory, memory_estimate, memory_from_preset
from dflash_core.bench.offline import run_offline
from dflash_core.bench.output import BENCH_DIR_ENV, resolve_output_dir
from dflash_core.bench.prompts import SHIPPED_SETS, Prompt, load_prompts
from dflash_core.bench.report import format_offline, format_serve
from dflash_core.bench.schema import BENCH_SCHEMA, OFFLINE_SCHEMA, SCHEMA_VERSION, SERVE_SCHEMA, validate
from dflash_core.bench.serve import run_serve

__all__ = [
    "BENCH_DIR_ENV",
    "BENCH_SCHEMA",
    "OFFLINE_SCHEMA",
    "SCHEMA_VERSION",
    "SERVE_SCHEMA",
    "SHIPPED_SETS",
    "BenchError",
    "IdentityError",
    "Prompt",
    "build_parser",
    "distribution",
    "format_memory",
    "format_offline",
    "format_serve",
    "load_prompts",
    "main",
    "memory_estimate",
    "memory_from_preset",
    "resolve_output_dir",
    "run_offline",
    "run_serve",
    "spread",
    "validate",
]
