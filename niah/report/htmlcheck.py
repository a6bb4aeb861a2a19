"""Check the HTML report the way a reader sees it: rendered by headless Chromium.

:func:`check_report` loads a copy of ``report.html`` with a small script appended that, once the page has
loaded, counts the images the browser actually decoded and collects the text of every table; Chromium's
``--dump-dom`` prints the page after that script ran.  It also prints the report to PDF and takes a
screenshot of the top of the page, next to the report, for a human to look at.  Chromium is Debian's
``chromium`` package (``apt-get install chromium``); nothing here needs a display or a GPU.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
_PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const out = document.createElement('pre');
  out.id = 'niah-report-check';
  out.textContent = JSON.stringify({
    images: imgs.length,
    decoded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
    tables: [...document.querySelectorAll('table')].map(t => t.innerText),
    headings: [...document.querySelectorAll('h1, h2')].map(h => h.innerText.trim()),
    wide: [...document.querySelectorAll('table')]
      .filter(t => t.getBoundingClientRect().right > document.documentElement.clientWidth + 1).length,
  });
  document.body.appendChild(out);
});
</script>"""


PRINT_WIDTH_PX = 1047  # A4 landscape less 10 mm margins at 96 px per inch: the width report.pdf prints tables at
# The report's print layout: A4 landscape, small table text, and cells that wrap long names instead of running off
# the page
PRINT_STYLE = """<style>
@page { size: A4 landscape; margin: 10mm; }
table { font-size: 8pt; max-width: 100%; }
td, th { padding: 1px 4px; overflow-wrap: anywhere; }
</style>"""


class ReportCheckError(RuntimeError):
    """The report, as rendered, lacks something a reader needs (or no browser is installed)."""


def find_browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise ReportCheckError(
        f"no headless browser found (looked for {', '.join(BROWSERS)}): "
        "install Debian's `chromium` (apt-get install chromium)"
    )


def _chromium(browser: str, *args: str, timeout: int = 120) -> str:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise ReportCheckError(f"{' '.join(cmd[:2])} ... failed ({done.returncode}): {done.stderr[-500:]}")
    return done.stdout


def rendered(report: Path, browser: str | None = None) -> dict:
    """What Chromium shows for ``report``: image counts (total, decoded), table texts, h1/h2 headings."""
    browser = browser or find_browser()
    probe = report.with_name(report.stem + ".check.html")
    probe.write_text(report.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    try:
        dom = _chromium(
            browser,
            f"--window-size={PRINT_WIDTH_PX},1400",
            "--virtual-time-budget=20000",
            "--dump-dom",
            probe.resolve().as_uri(),
        )
    finally:
        probe.unlink()
    found = re.search(r'<pre id="niah-report-check">(.*?)</pre>', dom, re.S)
    if not found:
        raise ReportCheckError(
            "Chromium rendered the report but the check script did not run (page did not finish loading)"
        )
    return json.loads(html.unescape(found.group(1)))


def check_report(report: Path, claim_ids: list[str], min_figures: int, browser: str | None = None) -> dict:
    """Render ``report``; raise :class:`ReportCheckError` unless at least ``min_figures`` images decode, none
    is broken, and one table holds every claim ID with a verdict.  Writes ``report.pdf`` and ``report.png``
    next to it.  Returns the rendered counts."""
    browser = browser or find_browser()
    seen = rendered(report, browser)
    problems = []
    if seen["wide"]:
        problems.append(
            f"{seen['wide']} table(s) wider than the printed page ({PRINT_WIDTH_PX} px): report.pdf would cut them"
        )
    if seen["decoded"] < min_figures:
        problems.append(f"{seen['decoded']} figures rendered, expected at least {min_figures}")
    if seen["decoded"] < seen["images"]:
        problems.append(f"{seen['images'] - seen['decoded']} of {seen['images']} images did not decode")
    # the ledger is the table naming most claim IDs; another table may cite a few of them
    ledgers = [
        t
        for t in seen["tables"]
        if sum(re.search(rf"\b{re.escape(c)}\b", t) is not None for c in claim_ids) > len(claim_ids) // 2
    ]
    if not ledgers:
        problems.append("no claims ledger table")
    else:
        missing = [c for c in claim_ids if not re.search(rf"\b{re.escape(c)}\b", ledgers[0])]
        if missing:
            problems.append(f"the ledger lacks claims {missing}")
        if not re.search(r"\b(supported|refuted|partly|inconclusive|untestable)\b", ledgers[0]):
            problems.append("the ledger has no verdicts")
    if problems:
        raise ReportCheckError(f"{report}: " + "; ".join(problems))
    pdf, png = report.with_suffix(".pdf"), report.with_suffix(".png")
    _chromium(browser, f"--print-to-pdf={pdf.resolve()}", "--no-pdf-header-footer", report.resolve().as_uri())
    _chromium(browser, f"--screenshot={png.resolve()}", "--window-size=1280,2000", report.resolve().as_uri())
    return {
        "figures": seen["decoded"],
        "tables": len(seen["tables"]),
        "headings": seen["headings"],
        "pdf": str(pdf),
        "png": str(png),
    }
