"""The README stays a door and the docs' links lead somewhere: the README is at most 300 lines with CI's test command
where `.ci/run` reads it, every relative link of README.md and docs/*.md names a file and a heading that exist, and
docs/architectures.md holds the zoo table that tests/zoo/results.json gives."""

import glob
import importlib.util
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_the_readme_is_a_door_with_the_test_command():
    readme = _read(os.path.join(ROOT, "README.md"))
    assert len(readme.splitlines()) <= 300
    after_marker = readme.split("<!-- test-command -->\n", 1)[1]
    assert after_marker.startswith('```bash\npython -m pytest tests -q -m "not slow"\n```')


def test_relative_links_name_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(_read(resolved)):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_architectures_page_holds_the_zoo_table_of_the_results():
    spec = importlib.util.spec_from_file_location("make_table", os.path.join(ROOT, "tests", "zoo", "make_table.py"))
    make_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_table)
    with open(make_table.RESULTS, encoding="utf-8") as f:
        table = make_table.table(json.load(f))
    assert f"{make_table.BEGIN}\n{table}\n{make_table.END}" in _read(make_table.PAGE)
    assert all(len(line) <= 1000 for line in table.splitlines())
