"""Render an explain page in a real browser: Debian's `chromium-headless-shell`, run as the tests and
`scripts/explain_screenshot.py` run it (no sandbox, no GPU, no network services, a throw-away
profile). `png_stats` decodes the screenshot (zlib + the PNG row filters, no image library) so a
test can check the page is not blank."""

from __future__ import annotations

import glob
import os
import shutil
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass

__all__ = ["PngStats", "dump_dom", "find_browser", "png_stats", "screenshot"]

_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
          "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def find_browser() -> str | None:
    """The chromium-headless-shell binary: on PATH, or in Debian's library directory."""
    found = shutil.which("chromium-headless-shell")
    if found:
        return found
    for path in ["/usr/lib/chromium-headless-shell/chromium-headless-shell", *glob.glob("/usr/lib/chromium*/headless_shell")]:
        if os.access(path, os.X_OK):
            return path
    return None


def _run(browser: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="aotgrad-chromium-") as profile:
        cmd = [browser, *_FLAGS, f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def screenshot(html_path: str, png_path: str, size: tuple[int, int] = (1200, 900), browser: str | None = None,
               timeout: float = 120) -> str:
    """Load `html_path` and write a `size` screenshot to `png_path`."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError("chromium-headless-shell not found (apt-get install chromium-headless-shell)")
    url = "file://" + os.path.abspath(html_path)
    proc = _run(browser, [f"--screenshot={os.path.abspath(png_path)}", f"--window-size={size[0]},{size[1]}", url],
                timeout)
    if not os.path.exists(png_path):
        raise RuntimeError(f"chromium wrote no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return png_path


def dump_dom(html_path: str, browser: str | None = None, timeout: float = 120) -> str:
    """The DOM after the browser parsed and laid out the page (`--dump-dom`)."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError("chromium-headless-shell not found (apt-get install chromium-headless-shell)")
    return _run(browser, ["--dump-dom", "file://" + os.path.abspath(html_path)], timeout).stdout


@dataclass(frozen=True)
class PngStats:
    width: int
    height: int
    mean: float  # over all channel samples, 0..255
    variance: float
    distinct_colours: int  # among sampled pixels


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def _unfilter(raw: bytes, width: int, height: int, bpp: int) -> list[bytearray]:
    stride = width * bpp
    rows: list[bytearray] = []
    prev = bytearray(stride)
    pos = 0
    for _ in range(height):
        kind, line = raw[pos], bytearray(raw[pos + 1 : pos + 1 + stride])
        pos += 1 + stride
        if kind == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif kind == 2:
            line = bytearray((x + y) & 255 for x, y in zip(line, prev))
        elif kind == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif kind == 4:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                up_left = prev[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + _paeth(left, prev[i], up_left)) & 255
        rows.append(line)
        prev = line
    return rows


def png_stats(path: str) -> PngStats:
    """Decode an 8-bit RGB/RGBA/grey PNG (what Chromium writes) and summarise its pixels."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or interlace:
        raise ValueError(f"unsupported PNG: bit depth {depth}, interlace {interlace}")
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    rows = _unfilter(zlib.decompress(b"".join(idat)), width, height, bpp)
    samples = [v for row in rows for v in row[: width * min(bpp, 3)]] if bpp < 3 else \
        [v for row in rows for i, v in enumerate(row) if i % bpp < 3]
    n = len(samples)
    mean = sum(samples) / n
    variance = sum((v - mean) ** 2 for v in samples) / n
    colours = {bytes(row[i : i + bpp]) for row in rows[::7] for i in range(0, width * bpp, 7 * bpp)}
    return PngStats(width, height, mean, variance, len(colours))
