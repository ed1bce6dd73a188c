"""dflash_core: the DFlash speculative-decoding engine (no HTTP).

Importing this package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it, and only
when torch has not been imported yet (the OpenMP runtime reads the variable once, when torch loads it; setting
it afterwards would change nothing and only mislead). On a CPU shared with other processes, OpenMP workers
that spin while idle make every small forward many times slower; PASSIVE lets them sleep. Every entry point
(``dflash-serve``, ``dflash-train``, ``dflash-bench``) and every library user that imports ``dflash_core``
before torch gets it; set ``OMP_WAIT_POLICY`` yourself to choose otherwise.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def _default_omp_wait_policy() -> None:
    if "torch" not in _sys.modules:
        _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_default_omp_wait_policy()
