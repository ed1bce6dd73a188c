"""The native target's forward on a CPU as one compiled C call (`fused.py`, built by `build.py`)."""
