"""The README stays a page a newcomer reads in minutes, and every topical page is reachable from it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_BYTES = 12 * 1024  # what fits a five-minute read; the detail lives in docs/


def test_the_readme_is_short():
    assert len(README.read_bytes()) <= MAX_BYTES, f"README.md is {len(README.read_bytes())} bytes"


def test_every_doc_page_is_linked_and_every_link_resolves():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert all((ROOT / link).is_file() for link in links), [link for link in links if not (ROOT / link).is_file()]
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - set(links) == set(), f"pages the README does not link: {sorted(pages - set(links))}"


def test_the_quick_start_is_the_two_commands():
    start = README.read_text().split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in start.strip().splitlines()] == ["make pretrain", "make test"]
