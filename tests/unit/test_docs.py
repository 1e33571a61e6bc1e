"""The documentation holds together: every relative link and image in README.md and docs/*.md (and the two other
READMEs) reaches a file that exists (and an `#anchor` a heading of that file, slugged as GitHub does), the README
stays a front page, and nothing cites the protocol summary that lives outside the repository. Reads files only: no
TensorFlow."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

# The repository root, wherever in tests/ this file sits.
ROOT = next(d for d in Path(__file__).resolve().parents if (d / "pyproject.toml").is_file())
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "deploy" / "spark" / "README.md", ROOT / "exported_models" / "README.md"]
README_MAX_LINES = 160
# Built from parts so that this file does not match itself.
OUTSIDE_CITATION = "SPEC " + "\u00a7"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG_SRC = re.compile(r"<img\b[^>]*?\bsrc=\"([^\"]+)\"", re.DOTALL)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def without_code(text: str) -> str:
    """Markdown with fenced blocks blanked (lines kept), so a `# comment` in a shell block is no heading."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: link targets and code marks dropped, lower case, punctuation other than
    `-` and `_` removed, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor the page's headings make, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for _, text in HEADING.findall(without_code(page.read_text())):
        slug = github_slug(text)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_targets(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", without_code(page.read_text()))
    targets = LINK.findall(text) + IMG_SRC.findall(text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def broken_targets(page: Path) -> list[str]:
    broken = []
    for target in relative_targets(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading in {file.name} has the anchor #{anchor}")
    return broken


def repository_files() -> list[Path]:
    """The files git tracks, or, outside a checkout (an unpacked sdist), every file under the root."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout
        names = [n for n in listed.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(Path(d, f).relative_to(ROOT)) for d, dirs, files in os.walk(ROOT)
                 for f in files if not any(part.startswith(".") for part in Path(d, f).relative_to(ROOT).parts)]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def cites_outside(name: str) -> bool:
    return name.endswith((".py", ".md", ".toml")) or Path(name).name == "Dockerfile" or name.startswith("deploy/")


def test_the_slugs_are_githubs():
    assert github_slug("Petal's own flags") == "petals-own-flags"
    assert github_slug("`--grpc_socket_path`") == "--grpc_socket_path"
    assert github_slug("KServe V2 / Open Inference Protocol (REST and gRPC ports)") == \
        "kserve-v2--open-inference-protocol-rest-and-grpc-ports"
    assert github_slug("Batch prediction (`petal batch`)") == "batch-prediction-petal-batch"


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text("# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://example.com/x)\n"
                    "```sh\n# not a heading\n[in code](nowhere.md)\n```\n`[code](nowhere.md)`\n"
                    "[gone](missing.md) [bad anchor](other.md#nope) <img src=\"pic.png\">\n")
    problems = [line.split(":")[0] for line in broken_targets(page)]
    assert problems == ["missing.md", "other.md#nope", "pic.png"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_image_reaches_a_file_and_heading(page):
    assert broken_targets(page) == []


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_targets(ROOT / "README.md")}
    assert set(DOCS) <= linked


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move topics to docs/"


def test_no_file_cites_the_protocol_summary_outside_the_repository():
    files = [f for f in repository_files() if cites_outside(str(f.relative_to(ROOT)))]
    assert ROOT / "README.md" in files and Path(__file__).resolve() in files
    citing = [f"{f.relative_to(ROOT)}:{n}" for f in files
              for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if OUTSIDE_CITATION in line]
    assert citing == [], "cite the docs/ page and section that states the fact instead"


# A path into the repository's own code folders, as docs and docstrings name them (`tests/e2e/test_rest.py`).
CITED_PATH = re.compile(r"(?<![\w./-])((?:tests|serving|training|load_tests|benchmarks|exported_models|deploy)"
                        r"/[\w./-]*\w\.(?:py|sh|toml|json|md|yaml))")


def test_every_repository_file_a_page_or_docstring_names_exists():
    """Moving a file (a test into its tier, a package rename) must not leave pages and docstrings pointing at it."""
    files = [f for f in repository_files() if f.suffix in (".py", ".md", ".toml") or f.name in ("Dockerfile", "run")]
    missing = [f"{f.relative_to(ROOT)}:{n}: {path}" for f in files
               for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
               for path in CITED_PATH.findall(line) if not (ROOT / path).exists()]
    assert missing == []
