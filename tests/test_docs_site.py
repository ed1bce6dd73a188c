"""The documentation site (mkdocs.yml + docs/) and the README that points into it.

Every page is in the navigation, the README's links resolve (files and anchors), the repository paths the pages
name exist, the README stays a five-minute read, the pasted /tokenize outputs are the demo tokenizer's, and
`mkdocs build --strict` passes and fails on a broken link or anchor (when the `docs` extra is installed:
`pip install -e ".[docs]"`; .ci/run installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text(encoding="utf-8")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def nav_pages() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages: list[str] = []

    def walk(items: list) -> None:
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                walk(value)
            else:
                pages.append(value)

    walk(config["nav"])
    return pages


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (mkdocs' default slugify)."""
    text = re.sub(r"`|\*\*|\[([^]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M)}


def test_every_page_is_in_the_navigation() -> None:
    pages = nav_pages()
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk, "mkdocs.yml's nav and docs/*.md differ"
    assert len(pages) == len(set(pages))


def test_readme_links_resolve() -> None:
    broken = []
    for target in LINK.findall(README):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"README links that do not resolve: {broken}"


def test_repository_paths_named_in_the_docs_exist() -> None:
    """A file or folder of the repository named in code (`tests/test_hybrid.py`, `docker/k8s/...`) exists: mkdocs
    checks links between pages, this checks what the pages name outside docs/."""
    named = re.compile(r"`((?:dflash_core|server|tests|scripts|docker|configs|docs|\.ci)/[\w./*-]*)`")
    missing = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for path in named.findall(page.read_text(encoding="utf-8")):
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, f"the docs name paths that do not exist: {missing}"


def test_readme_is_a_five_minute_read() -> None:
    """What it is, quick start, one example per main feature, the performance table, links: the rest is in docs/."""
    words = len(re.sub(r"```.*?```", "", README, flags=re.S).split())
    assert words < 1500, f"README has {words} words outside code blocks; move detail to docs/"
    assert len(README.splitlines()) < 200
    for page in nav_pages():
        assert f"(docs/{page})" in README, f"README does not link docs/{page}"


def test_pasted_tokenize_outputs_are_the_demo_tokenizers() -> None:
    """The `# {...}` line under each /tokenize and /detokenize curl is what the demo pair answers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "dflash_core" / "demo_models" / "target")
    checked = 0
    for text in (README, (DOCS / "api.md").read_text(encoding="utf-8")):
        lines = text.splitlines()
        for line, shown in zip(lines, lines[1:]):
            route = re.search(r"/(tokenize|detokenize) .*-d '(.+)'$", line)
            if not route or not shown.startswith("# {"):
                continue
            body, answer = json.loads(route.group(2)), json.loads(shown[2:])
            if route.group(1) == "detokenize":
                assert tok.decode(body["tokens"]) == answer["prompt"], line
            elif "prompt" in body:
                assert tok(body["prompt"])["input_ids"] == answer["tokens"], line
            else:
                rendered = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
                assert tok(rendered, add_special_tokens=False)["input_ids"] == answer["tokens"], line
            if "tokens" in answer:
                assert answer["count"] == len(answer["tokens"])
            checked += 1
    assert checked >= 4


def _mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=240, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def mkdocs_available() -> None:
    pytest.importorskip("mkdocs", reason='the docs extra is not installed: pip install -e ".[docs]"')
    pytest.importorskip("material", reason='the docs extra is not installed: pip install -e ".[docs]"')


def test_strict_build_passes(mkdocs_available, tmp_path: Path) -> None:
    res = _mkdocs_build(ROOT, tmp_path / "site")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link_or_anchor(mkdocs_available, tmp_path: Path) -> None:
    """The link check is on: mkdocs.yml's `validation:` makes both warnings, and `strict` makes warnings fatal."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "index.md").open("a") as f:
        f.write("\n[gone](no-such-page.md) and [moved](api.md#no-such-anchor)\n")
    res = _mkdocs_build(tmp_path, tmp_path / "site")
    assert res.returncode != 0
    assert "no-such-page.md" in res.stderr and "no-such-anchor" in res.stderr
