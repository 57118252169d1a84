"""Links in the docs lead somewhere: docs/benchmarks.md points into docs/journal/ by heading
anchors, code comments cite docs by path, and the docs tell users to run `python -m MODULE`,
so a renamed heading, a moved file or a moved module would otherwise leave a dead reference
that nobody notices."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = {"runs", "node_modules", "__pycache__"}  # and hidden folders: .git, .venv (make test's), .whl


def tracked(suffix: str) -> list[Path]:
    """The repository's files ending in `suffix`, without walking into a venv or run folders."""
    out = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(".")]
        out += [Path(folder, f) for f in files if f.endswith(suffix)]
    return sorted(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def dead_links(md: Path) -> list[str]:
    dead = []
    for number, line in enumerate(md.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (md.parent / path) if path else md
            if not file.exists():
                dead.append(f"{md.relative_to(REPO)}:{number}: no file {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                dead.append(f"{md.relative_to(REPO)}:{number}: no heading for #{anchor} in {target}")
    return dead


def test_slug_is_githubs():
    assert slug("Weight sync on one GPU: megatron vs memcpy (`bench/weight_sync.py`)") == \
        "weight-sync-on-one-gpu-megatron-vs-memcpy-benchweight_syncpy"
    assert slug("Side by side at shares that compute right: GRPO 0.91x") == \
        "side-by-side-at-shares-that-compute-right-grpo-091x"


@pytest.mark.timeout(30)
def test_every_markdown_link_finds_its_file_and_heading():
    dead = [d for md in tracked(".md") for d in dead_links(md)]
    assert not dead, "dead links:\n" + "\n".join(dead)


@pytest.mark.timeout(30)
def test_every_docs_path_a_source_file_cites_exists():
    """`docs/design.md`, `docs/journal/` and the like, as comments and docstrings cite them."""
    dead = []
    for source in tracked(".py") + tracked(".sh"):
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for cited in re.findall(r"\bdocs/[\w./-]*\w/?", line):
                if not (REPO / cited).exists():
                    dead.append(f"{source.relative_to(REPO)}:{number}: {cited}")
    assert not dead, "cited docs that do not exist:\n" + "\n".join(dead)


@pytest.mark.timeout(30)
def test_every_python_m_module_the_docs_name_exists():
    """`python -m MODULE` in the README, docs/ (not the journal: it is history), bench/ scripts,
    .ci/gpu and the Makefile names a module that is there (found, not imported)."""
    places = [REPO / "README.md", REPO / "Makefile", REPO / ".ci" / "gpu", *sorted((REPO / "docs").glob("*.md")),
              *sorted((REPO / "bench").glob("*.sh"))]
    missing = []
    for place in places:
        for module in sorted(set(re.findall(r"python3? -m ([A-Za-z_][\w.]*\w)", place.read_text()))):
            if module.split(".")[0] in {"pytest", "pip", "venv"}:
                continue
            if importlib.util.find_spec(module) is None:
                missing.append(f"{place.relative_to(REPO)}: python -m {module}")
    assert not missing, "modules the docs run that do not exist:\n" + "\n".join(missing)
