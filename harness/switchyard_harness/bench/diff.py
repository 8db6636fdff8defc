"""``switchyard bench diff BEFORE.json AFTER.json``: two ghz-format reports side by side, with the change.

Reads reports written by ghz itself (``ghz -O json``) or by ``switchyard bench
run`` (ghz's fields plus a ``switchyard`` section; see report.py and
ghz_schema.py). Prints, for each run: calls, rps, average, fastest, slowest,
latency P50/P95/P99 (ghz's own ``latencyDistribution``, successful calls), the
status codes and errors, and where the reports hold them the TTFT P50/P95/P99,
tokens/s and per-priority-class calls, errors and P95 (``switchyard`` section).
Every number is the report's own, unrounded but for display: nothing is
recomputed from ``details``. The change is after - before, and the ratio
where both are non-zero.

``--plot PNG`` writes both runs' latency distributions: the cumulative
distribution of every successful call's latency from ``details`` (ghz keeps
them, up to its details limit) and the percentiles of ``latencyDistribution``.

Exit status: 0; 2 when a file is missing or not a ghz report: a key missing, or
a key it reads holding the wrong type, such as a string where a number belongs
(naming the file and the key).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from switchyard.common.cli_text import parser_for
from switchyard.common import outputs
from switchyard.common.priority import LABELS

REQUIRED = ("count", "total", "average", "fastest", "slowest", "rps", "statusCodeDistribution", "latencyDistribution")
"""Keys every ghz JSON report carries (ghz runner/reporter.go ``Report``)."""
QUANTILES = (50, 95, 99)


class ReportError(ValueError):
    """A file that is not a ghz JSON report (the message names the file and what is wrong)."""


# What this command reads of a report, and of what type: a number is a JSON number, finite and >= 0 (not a
# string, not a boolean); the rest of the report is left as it is. Checked before anything is printed, so a
# report with a wrong value is named with its key instead of failing half-way through the table.
_Number = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]


class _Read(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Quantile(_Read):
    percentage: _Number
    latency: _Number


class _Detail(_Read):
    latency: _Number
    error: Annotated[str, Field(strict=True)] | None = None


class _Group(_Read):
    count: _Number | None = None
    errors: _Number | None = None
    latencyDistribution: list[_Quantile] | None = None


class _Streaming(_Read):
    ttftDistribution: list[_Quantile] | None = None
    tokensPerSecond: _Number | None = None
    byPriority: dict[str, _Group | None] | None = None


class _Report(_Read):
    count: _Number
    total: _Number
    average: _Number
    fastest: _Number
    slowest: _Number
    rps: _Number
    statusCodeDistribution: dict[str, _Number]
    errorDistribution: dict[str, _Number] | None = None
    latencyDistribution: list[_Quantile] | None
    details: list[_Detail] | None = None
    switchyard: _Streaming | None = None


def _where(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the key reads in the file: ``latencyDistribution[2].latency``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check(report: dict[str, Any], path: str | Path) -> None:
    """Check the keys this command reads (see :class:`_Report`) hold values of the right type.

    Raises:
        ReportError: the first key that does not, named as ``path: key: what was expected, got value``.
    """
    try:
        _Report.model_validate(report)
    except ValidationError as exc:
        error = exc.errors()[0]
        expected = error["msg"][0].lower() + error["msg"][1:]
        raise ReportError(f"{path}: {_where(error['loc'])}: {expected}, got {error['input']!r} (not a ghz JSON "
                          "report as ghz -O json or switchyard bench run -o write it)") from None


@dataclass(frozen=True)
class Row:
    """One figure of both runs: ``unit`` ``ms`` (values in ms), ``rps``, ``count``, ``tokens/s``."""

    name: str
    before: float | None
    after: float | None
    unit: str


def load(path: str | Path) -> dict[str, Any]:
    """A ghz JSON report from ``path``.

    Raises:
        ReportError: unreadable, not JSON (or not UTF-8), missing one of :data:`REQUIRED`, or a key this command reads holds
            a value of the wrong type (a string where a number belongs: :func:`check`).
    """
    try:
        # Bytes, so that json finds the encoding as RFC 8259 allows it: UTF-8 with or without a BOM, and the
        # UTF-16 with a BOM that PowerShell's `ghz ... > report.json` writes.
        report = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ReportError(f"{path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: not JSON: expected UTF-8 text (byte 0x{exc.object[exc.start]:02X} at offset "
                          f"{exc.start} is not {exc.encoding})") from None
    if not isinstance(report, dict):
        raise ReportError(f"{path}: expected a ghz JSON report (an object), got {type(report).__name__}")
    missing = [key for key in REQUIRED if key not in report]
    if missing:
        raise ReportError(f"{path}: not a ghz JSON report: no {', '.join(missing)} (write it with ghz -O json "
                          "or switchyard bench run -o)")
    check(report, path)
    return report


def _ms(nanos: Any) -> float | None:
    return None if nanos is None else nanos / 1e6


def quantiles(distribution: list[dict[str, Any]] | None) -> dict[int, float]:
    """``latencyDistribution``-shaped list -> {percentage: ms}; empty when the run had no successful call."""
    return {int(d["percentage"]): d["latency"] / 1e6 for d in distribution or []}


def rows(before: dict[str, Any], after: dict[str, Any]) -> list[Row]:
    """The figures both reports are compared on, in print order (see the module docstring)."""
    qb, qa = quantiles(before["latencyDistribution"]), quantiles(after["latencyDistribution"])

    def timing(report: dict[str, Any], measured: dict[int, float], key: str) -> float | None:
        return _ms(report[key]) if measured else None  # no successful call: no latency to show (its 0 is none)

    out = [
        Row("calls", before["count"], after["count"], "count"),
        Row("rps", before["rps"], after["rps"], "rps"),
        *(Row(key, timing(before, qb, key), timing(after, qa, key), "ms") for key in ("average", "fastest", "slowest")),
    ]
    out += [Row(f"latency P{q}", qb.get(q), qa.get(q), "ms") for q in QUANTILES]
    codes = sorted(set(before["statusCodeDistribution"]) | set(after["statusCodeDistribution"]),
                   key=lambda c: (c != "OK", c))
    out += [Row(f"status {code}", before["statusCodeDistribution"].get(code, 0),
                after["statusCodeDistribution"].get(code, 0), "count") for code in codes]
    errors_b = sum((before.get("errorDistribution") or {}).values())
    errors_a = sum((after.get("errorDistribution") or {}).values())
    out.append(Row("errors", errors_b, errors_a, "count"))
    sb, sa = before.get("switchyard") or {}, after.get("switchyard") or {}
    if sb.get("ttftDistribution") or sa.get("ttftDistribution"):
        tb, ta = quantiles(sb.get("ttftDistribution")), quantiles(sa.get("ttftDistribution"))
        out += [Row(f"TTFT P{q}", tb.get(q), ta.get(q), "ms") for q in QUANTILES]
    if "tokensPerSecond" in sb or "tokensPerSecond" in sa:
        out.append(Row("tokens/s", sb.get("tokensPerSecond"), sa.get("tokensPerSecond"), "tokens/s"))
    pb, pa = sb.get("byPriority") or {}, sa.get("byPriority") or {}
    for cls in sorted(set(pb) | set(pa), key=lambda c: ((*LABELS, c).index(c), c)):  # classes in rank order
        gb, ga = pb.get(cls) or {}, pa.get(cls) or {}
        out.append(Row(f"{cls} calls", gb.get("count"), ga.get("count"), "count"))
        out.append(Row(f"{cls} errors", gb.get("errors"), ga.get("errors"), "count"))
        out.append(Row(f"{cls} P95", quantiles(gb.get("latencyDistribution")).get(95),
                       quantiles(ga.get("latencyDistribution")).get(95), "ms"))
    return out


def _show(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "count":
        return f"{value:g}"
    if unit == "ms":
        return f"{value:.2f} ms"
    return f"{value:.2f}"


def _change(row: Row) -> str:
    if row.before is None or row.after is None:
        return ""
    delta = row.after - row.before
    sign = "+" if delta > 0 else ""
    shown = f"{sign}{delta:g}" if row.unit == "count" else f"{sign}{delta:.2f}{' ms' if row.unit == 'ms' else ''}"
    if row.before and row.after:
        shown += f"  (x{row.after / row.before:.3f})"
    return shown


def render(before: dict[str, Any], after: dict[str, Any], names: tuple[str, str]) -> str:
    """The side-by-side table this command prints."""
    table = rows(before, after)
    width = max(len(r.name) for r in table) + 2
    columns = [max(14, len(names[0])), max(14, len(names[1]))]
    lines = [f"{'':<{width}}{names[0]:>{columns[0]}}  {names[1]:>{columns[1]}}  change"]
    for r in table:
        lines.append(f"{r.name:<{width}}{_show(r.before, r.unit):>{columns[0]}}  "
                     f"{_show(r.after, r.unit):>{columns[1]}}  {_change(r)}")
    return "\n".join(lines)


def latencies_ms(report: dict[str, Any]) -> list[float]:
    """Every successful call's latency in ``details``, ms, ascending (empty when the report kept none)."""
    return sorted(d["latency"] / 1e6 for d in report.get("details") or [] if not d.get("error"))


def plot(before: dict[str, Any], after: dict[str, Any], names: tuple[str, str], path: Path) -> Path:
    """A PNG of both runs' latency distributions: the CDF of ``details`` and ``latencyDistribution``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_q) = plt.subplots(1, 2, figsize=(11, 4))
    for report, name, colour in ((before, names[0], "tab:blue"), (after, names[1], "tab:orange")):
        values = latencies_ms(report)
        if values:
            ax_cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=colour,
                        label=f"{name} ({len(values)} calls)")
        q = quantiles(report["latencyDistribution"])
        if q:
            ax_q.plot(list(q), list(q.values()), "o-", color=colour, label=name)
    ax_cdf.set_title("Latency CDF (details, successful calls)")
    ax_cdf.set_xlabel("latency, ms")
    ax_cdf.set_ylabel("fraction of calls")
    ax_q.set_title("Latency percentiles (latencyDistribution)")
    ax_q.set_xlabel("percentile")
    ax_q.set_ylabel("latency, ms")
    for ax in (ax_cdf, ax_q):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right" if ax is ax_cdf else "upper left")
    fig.suptitle(f"switchyard bench diff: {names[0]} vs {names[1]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    path = path if path.suffix else path.with_name(path.name + ".png")  # what savefig writes: say the same
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    parser = parser_for("switchyard bench diff", __doc__)
    parser.add_argument("before", help="the first ghz JSON report (ghz -O json, or switchyard bench run -o)")
    parser.add_argument("after", help="the second report")
    parser.add_argument("--plot", metavar="PNG", help="write both runs' latency distributions to this PNG "
                        "(default: bench-diff.png beside AFTER)")
    parser.add_argument("--no-plot", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.plot and not args.no_plot and (problem := outputs.unwritable(args.plot)):  # found before the work
        parser.error(f"--plot: expected a PNG file that can be written ({problem})")
    try:
        before, after = load(args.before), load(args.after)
    except ReportError as exc:
        print(f"switchyard bench diff: {exc}", file=sys.stderr)
        return 2
    names = (Path(args.before).stem, Path(args.after).stem)
    if names[0] == names[1]:
        names = ("before", "after")
    print(render(before, after, names))
    if not args.no_plot:
        path = Path(args.plot) if args.plot else Path(args.after).with_name("bench-diff.png")
        try:
            written = plot(before, after, names, path)
        except OSError as exc:
            print(f"switchyard bench diff: --plot {path}: could not write the plot ({exc.strerror or exc})",
                  file=sys.stderr)
            return 1
        print(f"\nplot written to {written}")
    return 0

