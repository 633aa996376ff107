"""The docs stay true to their sources: every rendered figure matches benchmarks/results/*.json and
the planner (benchmarks/render_docs.py --check), every page the README names exists, and every
relative link, anchors included, resolves."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "slurm" / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Text about the machines bigclip is developed on, which no user has.
DEVELOPMENT_MACHINES = ("loaned machine", "lent gpu", "device minutes", "device-minutes", "development box",
                        "mib per transfer", "minutes per command", "mib carried per call")  # fmt: skip


def load_render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_rendered_regions_match_their_sources():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "render_docs.py"), "--check"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_stale_region_is_rewritten_and_an_unknown_one_refused():
    render_docs = load_render_docs()
    text = "a\n<!-- rendered: tokenizer -->\nold figures\n<!-- /rendered -->\nb\n"
    new = render_docs.rendered_text(text, {"tokenizer"}, {})
    data = json.loads((ROOT / "benchmarks" / "results" / "tokenizer.json").read_text())
    assert "old figures" not in new and new.startswith("a\n") and new.endswith("<!-- /rendered -->\nb\n")
    assert f"commit {data['commit']}" in new and f"{data['rows'][0]['speedup']:.2f}x" in new
    with pytest.raises(SystemExit, match="unknown region 'no_such_thing'"):
        render_docs.rendered_text("<!-- rendered: no_such_thing -->\n<!-- /rendered -->", set(), {})


def test_test_times_render_from_their_file_or_say_not_yet_measured(tmp_path):
    doc_tables = load_render_docs().doc_tables
    assert doc_tables.render("test_times", tmp_path).startswith("Not yet measured")
    rows = [{"tier": "test-fast", "seconds": 240.0}, {"tier": "test", "seconds": 2280.0}]
    payload = {
        "rows": rows,
        "date": "2030-01-02T03:04:05+00:00",
        "commit": "abc1234",
        "device": "CI, 2 cores",
    }
    (tmp_path / "test_times.json").write_text(json.dumps(payload))
    table = doc_tables.render("test_times", tmp_path)
    assert "| `make test-fast` | 4.0 |" in table and "| `make test` | 38.0 |" in table
    assert "2030-01-02 at commit abc1234 on CI, 2 cores" in table


def test_every_docs_page_is_linked_from_the_readme_and_exists():
    linked = {
        (ROOT / t.split("#")[0]).resolve()
        for t in relative_links(ROOT / "README.md")
        if t.startswith("docs/")
    }
    assert linked, "the README links to no docs/ page"
    missing = sorted(str(p.relative_to(ROOT)) for p in linked if not p.exists())
    assert not missing, f"README links to pages that do not exist: {missing}"
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in linked)
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_docs_describe_users_machines_not_the_development_ones():
    found = [(p.name, s) for p in PAGES for s in DEVELOPMENT_MACHINES if s in p.read_text().lower()]
    assert not found, found
