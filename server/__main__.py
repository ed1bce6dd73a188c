"""``dflash-serve`` / ``python -m server``: parse settings, start uvicorn, exit 0 on SIGTERM."""

from __future__ import annotations

import os

# Before torch (and its OpenMP runtime) loads: on a CPU shared with other processes, spinning OpenMP workers make
# every small forward many times slower; PASSIVE lets idle workers sleep. An explicit setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import uvicorn  # noqa: E402

from server.app import create_app  # noqa: E402
from server.logs import setup_logging  # noqa: E402
from server.settings import Settings, build_parser, resolve_settings  # noqa: E402

log = logging.getLogger("dflash.server")
GRACEFUL_SHUTDOWN_S = 30


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM / SIGINT; 0 after a clean shutdown, 1 when the models fail to load."""
    try:
        settings: Settings = resolve_settings(argv)
    except (ValueError, TypeError, OSError) as e:
        build_parser().error(str(e))
    setup_logging(settings.log_level, settings.log_json)
    log.info("settings: %s", settings.public_dict())

    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failed.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_error=on_load_error)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        access_log=settings.log_level.lower() == "debug",
    )
    server = uvicorn.Server(config)

    # uvicorn drains in-flight requests on SIGTERM / SIGINT, then re-raises the signal once it is done;
    # a drained server exits 0, so the re-raised signal is ignored.
    def _drained(signum: int, frame: Any) -> None:
        log.info("shut down after signal %d", signum)

    signal.signal(signal.SIGTERM, _drained)
    signal.signal(signal.SIGINT, _drained)
    server.run()
    if failed:
        log.error("exiting: %s", failed[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
