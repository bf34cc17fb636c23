"""The documentation site builds with MkDocs in strict mode (no broken link, no page missing from the navigation),
and the README stays a page that gets a newcomer running."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_site_builds_strictly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "rules" / "index.html").exists()


def test_readme_is_short_and_links_every_docs_page():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(readme.splitlines()) <= 150
    pages = {f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")} - {"index.md"}
    missing = [p for p in sorted(pages) if f"(docs/{p}" not in readme]
    assert not missing, f"README.md links no page {missing}"
