"""dflash-serve: the OpenAI-compatible HTTP server (see server.app.create_app)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dflash-serve")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"
