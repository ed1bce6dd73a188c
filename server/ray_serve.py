"""``dflash-serve-ray`` / ``python -m server.ray_serve``: N replicas of the dflash-serve app behind Ray Serve.

Each replica is a Ray actor that loads its own models and runs the same FastAPI app as ``dflash-serve``
(``server.app.create_app``) with its own worker thread, so every route, stream and error envelope is the same.
Ray Serve's HTTP proxy routes each request to a replica by load (its ongoing requests; Ray's own router) and never
sends a replica more than ``max_running_requests + max_waiting_requests`` at once (the engine's queue), so a
replica does not answer 429 while another has room. With ``--max-replicas`` above ``--replicas`` the deployment
autoscales on ongoing requests per replica (``--target-ongoing-requests``).

Per replica: every response carries ``x-dflash-replica`` (the replica's id), and the replica's own Prometheus
registry is served on ``--replica-metrics-port`` + the replica's rank on its node, plus
``dflash_replica_info{replica, pid}``, so that Prometheus scrapes each replica (``GET /metrics`` through the proxy
reaches whichever replica the router picks). Needs the ``ray`` extra: ``pip install "dflash-serve[ray]"``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

# Before Ray loads: no usage report (nothing may leave the machine unasked).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import dflash_core  # noqa: E402,F401  # sets OMP_WAIT_POLICY=PASSIVE before torch loads (see its docstring)
from server.api_error import RETRY_AFTER_S  # noqa: E402
from server.logs import setup_logging  # noqa: E402
from server.settings import Settings, UsageError, build_parser, resolve_settings  # noqa: E402

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from server.state import ServerState

log = logging.getLogger("dflash.ray")

APP_NAME = "dflash"
DEPLOYMENT_NAME = "DFlashReplica"
REPLICA_HEADER = "x-dflash-replica"
HEALTH_CHECK_PERIOD_S = 5.0
STATUS_POLL_S = 1.0
SHUTDOWN_SLACK_S = 30.0  # beyond the drain: time for Ray to stop its actors
CONSTRUCTOR_RETRIES = 3


@dataclass(frozen=True)
class ScaleOut:
    """The Ray side of a scale-out: how many replicas, what each holds, which cluster."""

    replicas: int = 1
    min_replicas: int | None = None  # autoscaling bounds; None: fixed at `replicas`
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # default: the engine's max_running_requests
    replica_cpus: float = 1.0
    replica_gpus: float | None = None  # default: 1 when --device is cuda (or auto with CUDA visible), else 0
    replica_metrics_port: int = 9400  # replica of local rank r serves its registry on this + r; 0: off
    ray_address: str | None = None  # None: start a local Ray cluster
    ray_num_cpus: int | None = None  # CPUs of a local cluster (default: all)

    def validate(self) -> None:
        """Raise ValueError on an impossible combination (one line, naming the flag)."""
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            if low < 0 or not low <= self.replicas <= self.max_replicas:
                raise ValueError("autoscaling needs --min-replicas <= --replicas <= --max-replicas")
        elif self.min_replicas is not None:
            raise ValueError("--min-replicas needs --max-replicas (autoscaling)")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        if self.replica_cpus < 0 or (self.replica_gpus is not None and self.replica_gpus < 0):
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")
        if not 0 <= self.replica_metrics_port <= 65535:
            raise ValueError("--replica-metrics-port must be in 0..65535")
        if self.ray_num_cpus is not None and self.ray_num_cpus < 1:
            raise ValueError("--ray-num-cpus must be >= 1")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None


# --- the replica ---------------------------------------------------------------------------------------------


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that produced it (``x-dflash-replica``)."""

    def __init__(self, app: Any, replica_id: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def replica_registry(state: ServerState, replica_id: str) -> CollectorRegistry:
    """A registry for the replica's own metrics endpoint: the app's collectors (once its metrics exist) and
    ``dflash_replica_info{replica, pid}``."""
    from prometheus_client import CollectorRegistry, Gauge

    class AppCollectors:
        """Yields the app's collectors at scrape time: ``ServerMetrics`` is created when the worker starts."""

        def collect(self) -> Iterable[Any]:
            metrics = state.metrics
            return metrics.registry.collect() if metrics is not None else []

    registry = CollectorRegistry()
    registry.register(AppCollectors())  # type: ignore[arg-type]
    info = Gauge("dflash_replica_info", "This replica (value is always 1).", ["replica", "pid"], registry=registry)
    info.labels(replica=replica_id, pid=str(os.getpid())).set(1)
    return registry


def _replica_class() -> type:
    """The Ray Serve ingress class (built on demand: Ray is only imported by the ``ray`` extra's users)."""
    from ray import serve

    class DFlashReplica:
        """One engine on one worker thread behind the shared FastAPI app; Ray builds the app after ``__init__``."""

        async def __init__(self, settings: Settings, metrics_port: int) -> None:
            from dflash_core.config import EngineConfig
            from dflash_core.loading import load_models

            self.metrics_server: Any = None  # first: __del__ runs even when loading fails
            self.state: ServerState | None = None
            setup_logging(settings.log_level, settings.log_json)
            context = serve.get_replica_context()
            self.replica_id = context.replica_tag
            self.settings = settings
            # the replica is not up before its models are loaded AND warmed up: the proxy never routes to a
            # loading replica. The warm-up runs on the worker thread that will serve (recorded CUDA graphs are per
            # thread), so the app's state starts its worker here and this waits for it.
            from server.app import create_app

            try:
                models = await asyncio.to_thread(load_models, EngineConfig.from_settings(settings), False)
                self.asgi_app = create_app(settings, models=models)  # not `self.app`: a property of Ray's ingress
                self.state = self.asgi_app.state.dflash
                self.state.install(models, warm_up=True)
                while not self.state.ready:
                    if self.state.load_error is not None or not self.state.worker.is_alive():
                        raise RuntimeError(self.state.load_error or "the worker thread ended during its warm-up")
                    await asyncio.sleep(0.1)
            except Exception as e:
                # one line in the driver's log (Ray retries, then fails the deploy with its own traceback)
                log.error("replica %s: loading the models failed: %s", self.replica_id,
                          " ".join(f"{type(e).__name__}: {e}".split()))
                if self.state is not None and self.state.worker is not None:
                    self.state.worker.stop()
                raise
            self.asgi_app.add_middleware(ReplicaHeader, replica_id=self.replica_id)
            self.metrics_port = metrics_port + context.rank.local_rank if metrics_port else 0

        def __serve_build_asgi_app__(self) -> Any:
            """The dflash-serve app over this replica's models, its worker warmed up in ``__init__`` (Ray runs the
            app's lifespan, which then has nothing to start)."""
            if self.metrics_port:
                self._serve_metrics(self.metrics_port)
            return self.asgi_app

        def _serve_metrics(self, port: int) -> None:
            """This replica's registry on ``host:port`` (a thread of prometheus_client)."""
            from prometheus_client import start_http_server

            registry = replica_registry(self.state, self.replica_id)
            self.metrics_server, _ = start_http_server(port, addr=self.settings.host, registry=registry)
            log.info("replica %s: metrics on http://%s:%d/metrics", self.replica_id, self.settings.host, port)

        def check_health(self) -> None:
            """Ray's health check: the app's readiness (models loaded, worker thread alive)."""
            if self.state is None or not self.state.ready:
                raise RuntimeError(f"replica {self.replica_id}: the worker thread is not running")

        def __del__(self) -> None:
            if self.metrics_server is not None:
                self.metrics_server.shutdown()

    return serve.ingress()(DFlashReplica)


def build_application(settings: Settings, scale: ScaleOut) -> Any:
    """The Ray Serve application: the replica class as a deployment with the replica count or autoscaling."""
    from ray import serve

    deployment = serve.deployment(**deployment_options(settings, scale))(_replica_class())
    return deployment.bind(settings, scale.replica_metrics_port)


def deployment_options(settings: Settings, scale: ScaleOut) -> dict[str, Any]:
    """The keyword arguments of ``serve.deployment``: resources, load limits, health check, replicas."""
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": scale.replica_cpus, "num_gpus": _replica_gpus(settings, scale)},
        # the engine's capacity with its queue: beyond it a replica would answer 429, so Ray picks another replica
        # or queues the request; past --max-waiting-requests queued at the proxy, Ray answers 429 itself
        "max_ongoing_requests": settings.max_running_requests + settings.max_waiting_requests,
        "max_queued_requests": settings.max_waiting_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": RETRY_AFTER_S},
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,  # models that fail to load: fail the deploy soon
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": settings.shutdown_timeout,
    }
    if scale.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": scale.min_replicas if scale.min_replicas is not None else 1,
            "initial_replicas": scale.replicas,
            "max_replicas": scale.max_replicas,
            "target_ongoing_requests": scale.target_ongoing_requests or settings.max_running_requests,
        }
    else:
        options["num_replicas"] = scale.replicas
    return options


def _replica_gpus(settings: Settings, scale: ScaleOut) -> float:
    if scale.replica_gpus is not None:
        return scale.replica_gpus
    device = settings.device.strip().lower()
    if device.startswith("cuda"):
        return 1.0
    if device == "auto":
        import torch

        return 1.0 if torch.cuda.is_available() else 0.0
    return 0.0


# --- the command line ----------------------------------------------------------------------------------------

_SCALE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("replicas", int, "replicas to start, each with its own engine (fixed count; autoscaling: the initial one)"),
    ("min_replicas", int, "autoscaling: fewest replicas (default 1; needs --max-replicas)"),
    ("max_replicas", int, "autoscaling on ongoing requests per replica up to this many replicas (default: off)"),
    ("target_ongoing_requests", float, "autoscaling: ongoing requests per replica to aim for "
     "(default: --max-running-requests)"),
    ("replica_cpus", float, "CPUs Ray reserves per replica"),
    ("replica_gpus", float, "GPUs per replica (default: 1 with --device cuda or auto and CUDA visible, else 0)"),
    ("replica_metrics_port", int, "each replica serves its own /metrics on this port + its rank on the node "
     "(0: off)"),
    ("ray_address", str, "join this Ray cluster (default: start a local one)"),
    ("ray_num_cpus", int, "CPUs of the local Ray cluster (default: all)"),
)


def build_scale_parser() -> argparse.ArgumentParser:
    """The ``dflash-serve-ray`` command line: the scale-out flags, then every ``dflash-serve`` flag."""
    p = build_parser()
    p.prog = "dflash-serve-ray"
    p.description = (
        "dflash-serve on Ray Serve: N replicas (one engine each) behind Ray's HTTP proxy, routed by load, "
        "optionally autoscaled. --host / --port bind the proxy. Every dflash-serve flag applies to each replica."
    )
    group = p.add_argument_group("scale-out (Ray Serve)")
    defaults = ScaleOut()
    for name, kind, help_text in _SCALE_FLAGS:
        default = getattr(defaults, name)
        shown = f" (default: {default})" if default is not None else ""
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=default,
                           help=f"{help_text}{shown}".replace("%", "%%"), metavar=name.upper())
    return p


class _ScaleParser(argparse.ArgumentParser):
    """Parses the scale-out flags only; a malformed value raises UsageError (one line) instead of exiting."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(message)


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, ScaleOut]:
    """(settings of every replica, the scale-out) from the command line (and DFLASH_* / --config for settings)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        build_scale_parser().print_help()
        raise SystemExit(0)
    # no abbreviations: --target must stay dflash-serve's flag, not a prefix of --target-ongoing-requests
    scale_parser = _ScaleParser(add_help=False, allow_abbrev=False)
    for name, kind, _ in _SCALE_FLAGS:
        scale_parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    known, rest = scale_parser.parse_known_args(args)
    scale = ScaleOut(**{k: v for k, v in vars(known).items() if v is not None})
    scale.validate()
    settings = resolve_settings(rest)
    if settings.adapt_draft:  # every replica would train and swap on its own, into one folder
        raise ValueError("--adapt-draft is for one dflash-serve process: under Ray Serve, train with dflash-train "
                         "and redeploy with the new draft")
    return settings, scale


def serve_forever(settings: Settings, scale: ScaleOut) -> int:
    """Start Ray (or join it), run the application, wait for SIGTERM / SIGINT, then shut Serve down."""
    import ray
    from ray import serve

    if scale.ray_address is not None:
        ray.init(address=scale.ray_address, log_to_driver=True)
    else:
        ray.init(num_cpus=scale.ray_num_cpus, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(settings, scale), name=APP_NAME, route_prefix="/")
    except Exception as e:  # noqa: BLE001 - a failed deploy (models that do not load, a busy port): one line
        log.error("starting the Ray Serve application failed: %s", " ".join(f"{type(e).__name__}: {e}".split()))
        _shutdown(scale)
        return 1
    count = f"{scale.replicas} replica(s)" + (
        f", autoscaling {scale.min_replicas or 1}..{scale.max_replicas}" if scale.autoscaling else ""
    )
    log.info(
        "serving on http://%s:%d with %s (Ray cluster %s)",
        settings.host, settings.port, count, ray.get_runtime_context().gcs_address,
    )
    last = ""
    while not stop.wait(STATUS_POLL_S):
        last = _log_status_change(last)
    log.info("shutting down: Ray Serve drains the replicas for up to %g s", settings.shutdown_timeout)
    _shutdown(scale, deadline_s=settings.shutdown_timeout + SHUTDOWN_SLACK_S)
    return 0


def _log_status_change(last: str) -> str:
    """Log the deployment's status when it changed since ``last`` (replicas dying, restarting, scaling)."""
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception as e:  # noqa: BLE001 - the controller may be restarting: try again next time
        log.debug("serve.status() failed: %s", e)
        return last
    deployment = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
    if deployment is None:
        line = "the application is gone"
    else:
        states = ", ".join(f"{k}={v}" for k, v in sorted(deployment.replica_states.items()))
        line = f"deployment {DEPLOYMENT_NAME}: {deployment.status.value}, replicas {states}"
    if line != last:
        log.info("%s", line)
    return line


def _shutdown(scale: ScaleOut, deadline_s: float = SHUTDOWN_SLACK_S) -> None:
    """Remove the application (and the local cluster we started); exit hard past ``deadline_s`` (a cluster that
    lost a process can make Ray's shutdown wait forever)."""
    import ray
    from ray import serve

    watchdog = threading.Timer(deadline_s, _give_up, args=(deadline_s,))
    watchdog.daemon = True
    watchdog.start()
    try:
        if scale.ray_address is not None:
            serve.delete(APP_NAME)  # a shared cluster: only our application goes
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
        watchdog.cancel()


def _give_up(deadline_s: float) -> None:
    log.error("Ray did not shut down within %g s: exiting anyway", deadline_s)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run until SIGTERM / SIGINT: 0 after a clean stop, 1 when the deployment fails, 2 on bad settings."""
    try:
        settings, scale = parse_args(argv)
    except (ValueError, TypeError, OSError) as e:
        print(f"dflash-serve-ray: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_json)
    from server.__main__ import preflight

    problem = preflight(settings)
    if problem is not None:
        log.error("%s", problem)
        return 1
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        log.error("Ray Serve is not installed: pip install 'dflash-serve[ray]'")
        return 1
    return serve_forever(settings, scale)


if __name__ == "__main__":
    sys.exit(main())
