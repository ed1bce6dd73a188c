"""docs/architecture.md matches the code: every module it names exists, and every module is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("dflash_core", "server")


def named_paths() -> set[str]:
    return set(re.findall(r"`((?:dflash_core|server|tests)/[\w/]*(?:\.py|/))`", DOC.read_text()))


def test_every_module_named_in_the_architecture_doc_exists() -> None:
    missing = sorted(p for p in named_paths() if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_in_the_architecture_doc() -> None:
    named = named_paths()
    modules = [p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")]  # package markers and `python -m` entries
    left_out = sorted(
        m for m in modules
        if m not in named and not any(m.startswith(d) for d in named if d.endswith("/") and _is_leaf_dir(d))
    )
    assert not left_out, f"modules missing from docs/architecture.md: {left_out}"


def _is_leaf_dir(folder: str) -> bool:
    """A folder named as a whole (e.g. `dflash_core/demo/`) covers its modules when the doc lists none of them."""
    return folder.rstrip("/").count("/") >= 1 and not any(
        p.startswith(folder) and p != folder for p in named_paths())


def test_no_file_points_outside_the_repo() -> None:
    """Docs and code explain the project themselves: no pointer to a design document outside the repository."""
    offenders = []
    for path in [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"),
                 *[p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]]:
        if "../shared" in path.read_text(encoding="utf-8") or "DESIGN.md" in path.read_text(encoding="utf-8"):
            offenders.append(path.relative_to(ROOT).as_posix())
    assert not offenders, offenders


def test_names_in_the_module_map_are_in_their_modules() -> None:
    """Each row of the module map names classes and functions (`CamelCase`, `snake_case`) its module defines."""
    import importlib

    wrong = []
    for line in DOC.read_text().splitlines():
        row = re.match(r"\| `((?:dflash_core|server)/[\w/]+\.py)` \|(.*)\|$", line)
        if not row:
            continue
        module = importlib.import_module(row.group(1).removesuffix(".py").removesuffix("/__init__").replace("/", "."))
        for name in re.findall(r"`([A-Za-z_]\w*)`", row.group(2)):
            code_like = name[0].isupper() and not name.isupper() or "_" in name.strip("_") and name.islower()
            if code_like and not hasattr(module, name):
                wrong.append(f"{row.group(1)}: {name}")
    assert not wrong, f"docs/architecture.md names what its module does not define: {wrong}"
