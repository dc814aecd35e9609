"""The documentation's screenshots and the sources they show.

The browser tests take the pictures of ``docs/screenshots/``; run with
``JUPYTER_VGPU_UPDATE_SCREENSHOTS=1`` they write them there, and each one is recorded in
``docs/screenshots/sources.json`` with the SHA-256 of its PNG and of the sources that
drew it (:data:`SOURCES`: the JupyterLab extension's code and style, the Hub page's
templates). ``tests/unit/test_screenshots.py`` fails when a committed picture is not the
one recorded, or was taken from other sources than today's: the pictures cannot drift
from the panel unnoticed. Content hashes, not file times: a fresh clone gives every file
the same time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "screenshots"
MANIFEST = DOCS / "sources.json"
#: Folders whose files draw what the screenshots show, relative to the checkout.
SOURCES = ("labextension/src", "labextension/style", "hub_spawner/templates")
#: Setting this environment variable to 1 makes the browser tests refresh the pictures.
UPDATE_ENV = "JUPYTER_VGPU_UPDATE_SCREENSHOTS"
REFRESH = f"{UPDATE_ENV}=1 python -m pytest tests/browser, then commit docs/screenshots/"


def updating() -> bool:
    """True when the browser tests write the documentation's pictures."""
    return os.environ.get(UPDATE_ENV) == "1"


def sources_digest() -> str:
    """SHA-256 over every file under :data:`SOURCES` (relative path and content, line
    endings normalised to ``\\n``), in path order: hex string."""
    digest = hashlib.sha256()
    files = sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*") if p.is_file())
    for path in files:
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes: hex string."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest() -> dict:
    """``sources.json`` as a dict (an empty one when there is none yet)."""
    if not MANIFEST.exists():
        return {"sources": list(SOURCES), "screenshots": {}}
    return json.loads(MANIFEST.read_text(encoding="utf-8"))


def record(png: Path) -> None:
    """Record ``png`` (just written under ``docs/screenshots/``) as drawn by today's sources."""
    manifest = read_manifest()
    manifest["sources"] = list(SOURCES)
    manifest["screenshots"][png.name] = {"png_sha256": file_digest(png), "sources_sha256": sources_digest()}
    manifest["screenshots"] = dict(sorted(manifest["screenshots"].items()))
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def problems() -> list[str]:
    """What is wrong with ``docs/screenshots/``, one line per picture (empty: nothing)."""
    manifest = read_manifest()
    entries = manifest.get("screenshots", {})
    current = sources_digest()
    out = []
    if manifest.get("sources") != list(SOURCES):
        out.append(f"sources.json lists the sources {manifest.get('sources')}, not {list(SOURCES)}")
    for png in sorted(DOCS.glob("*.png")):
        entry = entries.get(png.name)
        if entry is None:
            out.append(f"{png.name}: not recorded in sources.json")
        elif entry.get("png_sha256") != file_digest(png):
            out.append(f"{png.name}: not the picture recorded in sources.json")
        elif entry.get("sources_sha256") != current:
            out.append(f"{png.name}: taken from other sources than today's {', '.join(SOURCES)}")
    for name in sorted(set(entries) - {p.name for p in DOCS.glob("*.png")}):
        out.append(f"{name}: recorded in sources.json but missing")
    return out
