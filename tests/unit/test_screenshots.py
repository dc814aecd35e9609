"""The README's pictures show today's panel: every picture in ``docs/screenshots/`` is the
one the browser tests recorded, taken from today's sources (``tests/screenshots.py``),
and every picture the README shows is there."""

import re

from .. import screenshots


def test_every_screenshot_was_taken_from_todays_sources():
    found = screenshots.problems()
    listed = "\n".join(found)
    assert not found, f"docs/screenshots/ is out of date:\n{listed}\nrefresh: {screenshots.REFRESH}"


def test_every_picture_the_readme_shows_is_there():
    readme = (screenshots.ROOT / "README.md").read_text(encoding="utf-8")
    shown = re.findall(r"\(docs/screenshots/([^)\s]+\.png)\)", readme)
    assert shown
    missing = [name for name in shown if not (screenshots.DOCS / name).is_file()]
    assert not missing, missing
