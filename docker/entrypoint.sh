#!/bin/sh
# Container entrypoint: with no arguments or with flags, run the server (`dflash-serve [FLAGS]`);
# anything else runs as a command (e.g. `docker run -it IMAGE bash`, `... IMAGE dflash-bench --help`).
# Settings come from flags > DFLASH_* environment > --config YAML (see configs/); the image sets
# DFLASH_HOST=0.0.0.0 and DFLASH_PORT=8000.
set -eu

if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    set -- dflash-serve "$@"
fi
exec "$@"
