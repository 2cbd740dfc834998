"""Helpers of the dashboard tests: HTTP GETs off the event loop, a tiny DOM reader, headless
Chromium run as a reaped process group."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")

#: Flags of every headless run: no network beyond the page's origin, no profile reuse.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


async def get(url: str) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers, body)`` of a GET, run in a thread (the server shares this loop)."""
    return await asyncio.get_running_loop().run_in_executor(None, _get, url)


async def get_json(url: str) -> Any:
    status, _, body = await get(url)
    assert status == 200, (status, body[:200])
    return json.loads(body)


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Element | None) -> None:
        self.tag = tag
        self.attrs = attrs
        self.parent = parent
        self.children: list[Element] = []
        self.text_parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.text_parts + [c.text for c in self.children]).strip()

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self) -> Any:
        yield self
        for c in self.children:
            yield from c.iter()

    def find_all(self, **match: str) -> list[Element]:
        """Descendants whose attributes equal ``match`` (``class_`` matches one class; ``tag``
        the tag name; underscores in other names read as dashes: ``data_field``)."""
        out = []
        for e in self.iter():
            ok = True
            for k, v in match.items():
                if k == "tag":
                    ok = ok and e.tag == v
                elif k == "class_":
                    ok = ok and v in e.classes()
                else:
                    ok = ok and e.attrs.get(k.replace("_", "-")) == v
            if ok:
                out.append(e)
        return out

    def find(self, **match: str) -> Element:
        found = self.find_all(**match)
        assert found, f"no element {match}"
        return found[0]


_VOID = {"meta", "link", "br", "img", "input", "hr", "area", "base", "col", "source", "wbr"}


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#root", {}, None)
        self.cur = self.root

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        e = Element(tag, {k: v or "" for k, v in attrs}, self.cur)
        self.cur.children.append(e)
        if tag not in _VOID:
            self.cur = e

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.cur.children.append(Element(tag, {k: v or "" for k, v in attrs}, self.cur))

    def handle_endtag(self, tag: str) -> None:
        node: Element | None = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.cur = node.parent

    def handle_data(self, data: str) -> None:
        self.cur.text_parts.append(data)


def parse_dom(html: str) -> Element:
    """The element tree of a serialized DOM (enough for the tests' queries)."""
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root


async def run_chromium(
    url: str, profile: Path, *extra: str, timeout_s: float = 90.0
) -> tuple[int, str, str]:
    """Run headless Chromium on ``url`` in its own process group, killed when it is done or
    times out (pass or fail, nothing is left running). Returns ``(rc, stdout, stderr)``."""
    proc = await asyncio.create_subprocess_exec(
        str(CHROMIUM),
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        *extra,
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its renderer and helper processes too
        if proc.returncode is None:
            await proc.wait()
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
