"""`python -m dflash_core.train`: the dflash-train command."""

from dflash_core.train.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
