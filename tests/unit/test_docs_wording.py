"""README.md and docs/ describe the product, not how it was made: no sessions, stops, lending or previous
machines, no lab-notebook asides. Measurements are dated tables, which this test leaves alone."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WORDS = [
    r"\bsessions?\b",
    r"\b(this|last|previous|earlier|next) stops?\b", r"\bstops? ago\b",
    r"\blent\b", r"\blending\b", r"\bbeen lent\b",
    r"\bprevious (machine|run|change|version of this page)\b", r"\bthe machine before\b",
    r"\bthe same hour\b", r"\btoday\b", r"\byesterday\b", r"\bthis morning\b",
    r"\bwe (tried|found|measured|noticed)\b", r"\bI (tried|found|measured)\b",
]
PATTERN = re.compile("|".join(WORDS), re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_speak_of_the_product_only(page):
    hits = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}"
            for n, line in enumerate(page.read_text().splitlines(), 1) for m in PATTERN.finditer(line)]
    assert not hits, "\n".join(hits)


def test_the_readme_is_a_product_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; at most 150"
    headings = [line for line in lines if line.startswith("## ")]
    for needed in ("## Which path is yours", "## Try it", "## Limitations", "## Documentation"):
        assert needed in headings, needed
