"""Headless Chromium on a report's index.html: screenshots and layout measurements.

The shipped report has no script. To measure, a copy of the page gets one small script that writes
the layout figures (page width and height, the widest table's right edge, where the verdict, each of
its lines and the table of contents end, each heatmap's natural and shown size) into the DOM, and Chromium's ``--dump-dom`` prints it back.

``python -m tests.browser REPORT_DIR OUT_DIR`` writes the screenshots for people (``make screenshots``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

WIDTH, HEIGHT = 1400, 900
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--run-all-compositor-stages-before-draw",
         "--virtual-time-budget=5000"]

MEASURE = """<script>
window.addEventListener('load', function () {
  var d = document.documentElement;
  var box = function (q) { var e = document.querySelector(q); return e ? e.getBoundingClientRect() : null; };
  var right = 0;
  document.querySelectorAll('table').forEach(function (t) {
    var b = t.getBoundingClientRect();
    right = Math.max(right, b.right, b.left + t.scrollWidth);
  });
  var v = box('section.verdict'), n = box('nav'), h = box('h2');
  var items = [];
  document.querySelectorAll('section.verdict li').forEach(function (li) {
    items.push({text: li.textContent.slice(0, 40), bottom: li.getBoundingClientRect().bottom});
  });
  var heatmaps = [];
  document.querySelectorAll('figure.heatmap img').forEach(function (img) {
    var b = img.getBoundingClientRect();
    heatmaps.push({alt: img.alt, natural_width: img.naturalWidth, natural_height: img.naturalHeight,
                   width: b.width, height: b.height});
  });
  var m = {scroll_width: d.scrollWidth, scroll_height: d.scrollHeight, table_right: right,
           verdict_bottom: v && v.bottom, nav_bottom: n && n.bottom, first_h2_top: h && h.top,
           verdict_items: items, heatmaps: heatmaps};
  var p = document.createElement('pre');
  p.id = 'moe-measure';
  p.textContent = JSON.stringify(m);
  document.body.appendChild(p);
});
</script>"""


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(args: list[str], timeout: float = 120) -> str:
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium is not installed")
    res = subprocess.run([exe, *FLAGS, *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"chromium failed ({res.returncode}): {res.stderr[-500:]}")
    return res.stdout


def measure(index_html: Path, work: Path, width: int = WIDTH) -> dict:
    """Layout figures of the page at ``width`` px (CSS pixels): a measuring copy in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    copy = work / f"measure-{width}.html"
    copy.write_text(index_html.read_text().replace("</body>", MEASURE + "</body>"))
    dom = _run([f"--window-size={width},{HEIGHT}", "--dump-dom", copy.resolve().as_uri()])
    m = re.search(r'<pre id="moe-measure">([^<]*)</pre>', dom)
    if m is None:
        raise RuntimeError("the measuring script wrote nothing")
    return json.loads(m.group(1).replace("&quot;", '"'))


def screenshot(index_html: Path, png: Path, width: int = WIDTH, height: int = HEIGHT) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    _run([f"--window-size={width},{height}", f"--screenshot={png.resolve()}", index_html.resolve().as_uri()])
    return png


def main(argv: list[str]) -> int:
    report, out = Path(argv[0]), Path(argv[1])
    index = report / "index.html"
    if chromium() is None:
        print("chromium is not installed: no screenshots (apt-get install chromium)")
        return 1
    m = measure(index, out / ".work")
    shutil.rmtree(out / ".work")
    screenshot(index, out / "first-screen-1400x900.png")
    screenshot(index, out / "full-page-1400.png", height=int(m["scroll_height"]) + 10)
    print(f"wrote {out}/first-screen-1400x900.png and {out}/full-page-1400.png (page {m['scroll_height']} px tall at "
          f"{WIDTH} px wide, widest table ends at {m['table_right']:.0f} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
