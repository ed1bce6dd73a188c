"""Test-wide settings: one compute thread per process.

The suite runs a pytest process beside server subprocesses on 2 cores; several OpenMP pools spinning on the same
cores make tiny-model forwards many times slower than one thread each.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
