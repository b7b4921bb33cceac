"""The documentation: the generated reference pages are current, the site builds with
`mkdocs build --strict` (no broken link or anchor), the README stays a five-minute read, every
`hivekeeper` command line in the README and the pages parses with the real command line, and
every repository path they name exists."""

from __future__ import annotations

import filecmp
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from hivekeeper import docs_reference
from hivekeeper.cli import build_parser, named_command

DOCS = REPO / "docs"
README = REPO / "README.md"
GENERATED = DOCS / "reference"
# The pages people write (the generated ones quote the code itself).
WRITTEN = [README, REPO / "CONTRIBUTING.md", *sorted(p for p in DOCS.rglob("*.md") if GENERATED not in p.parents)]


def test_generated_reference_pages_are_current(tmp_path):
    written = docs_reference.write_pages(tmp_path)
    names = sorted(p.name for p in written)
    committed = sorted(p.name for p in GENERATED.glob("*.md"))
    assert committed == names, f"docs/reference/ holds {committed}, the generator writes {names}"
    _, mismatch, errors = filecmp.cmpfiles(GENERATED, tmp_path, names, shallow=False)
    assert not mismatch and not errors, (f"stale generated pages: {mismatch + errors}; "
                                         "run `python -m hivekeeper.docs_reference`")


def test_the_check_mode_agrees():
    result = subprocess.run([sys.executable, "-m", "hivekeeper.docs_reference", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mkdocs_build_is_strict_clean(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                             "--config-file", str(REPO / "mkdocs.yml")], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_a_five_minute_read():
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes; keep it at most 12 KB"
    for needed in ("make demo", "make test", "hivekeeper up", "helm install", "<!-- ci-figures"):
        assert needed in text, needed
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)


def command_lines(text: str) -> list[str]:
    """The `hivekeeper ...` command lines of a page's code blocks, continuation lines joined,
    comments and [optional] parts dropped."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            match = re.match(r"^(?:\.venv/bin/)?hivekeeper\s+(.*)$", line)
            if match:
                found.append(re.sub(r"\[[^\]]*\]", "", match.group(1)).strip())
    return found


@pytest.mark.parametrize("page", WRITTEN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_command_parses(page):
    for line in command_lines(page.read_text()):
        argv = shlex.split(line)
        try:
            build_parser(named_command(argv)).parse_args(argv)
        except SystemExit as e:
            if e.code:  # --help and --version exit 0
                pytest.fail(f"{page.name}: `hivekeeper {line}` does not parse")


ROOTS = ("bench/", "charts/", "cluster/", "crds/", "docs/", "examples/", "operator/", "scripts/", "services/",
         "tests/")
SOURCE_DIRS = ("services/hivekeeper", "operator/hivekeeper_operator", "tests", "bench")


def named_paths(text: str) -> set[str]:
    """Repository paths a page names in code spans: from a top-level folder, or a module path
    relative to a source folder (`swarm/optimizer.py`)."""
    spans = re.findall(r"`([^`\s]+)`", text)
    blocks = " ".join(code_blocks(text)).split()
    return {token.rstrip(".,:;)") for token in spans + blocks
            if token.startswith(ROOTS) or (re.fullmatch(r"[\w/]+/\w+\.py", token) is not None)}


@pytest.mark.parametrize("page", WRITTEN, ids=lambda p: str(p.relative_to(REPO)))
def test_named_repository_paths_exist(page):
    missing = []
    for path in named_paths(page.read_text()):
        if path.startswith("bench/results/"):  # ignored by git: what a bench writes
            continue
        if path.startswith(ROOTS):
            if not list(REPO.glob(path.rstrip("/"))):
                missing.append(path)
        elif not any((REPO / root / path).exists() for root in SOURCE_DIRS):
            missing.append(path)
    assert not missing, f"{page.name} names paths that do not exist: {sorted(missing)}"
