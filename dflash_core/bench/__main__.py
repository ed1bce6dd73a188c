"""`python -m dflash_core.bench`: the `dflash-bench` command."""

import sys

from dflash_core.bench.cli import main

sys.exit(main())
