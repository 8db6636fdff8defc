"""`switchyard bench diff`: two reports written by real ghz (fixtures), and two written by `switchyard bench run`'s
own report code; every printed number is the report's own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from switchyard_harness.bench import diff
from switchyard_harness.bench.loadgen import CallResult, LoadPlan, LoadResult
from switchyard_harness.bench.report import build_report

pytestmark = pytest.mark.no_gpu
GHZ = Path(__file__).resolve().parents[1] / "data" / "ghz"


def by_name(before: dict, after: dict) -> dict[str, diff.Row]:
    return {r.name: r for r in diff.rows(before, after)}


def test_reports_written_by_ghz_compare_with_their_own_numbers(tmp_path, capsys):
    before, after = (json.loads((GHZ / f"greeter_{n}.json").read_text()) for n in ("before", "after"))
    rows = by_name(before, after)
    assert rows["calls"].before == before["count"] == 200 and rows["rps"].after == after["rps"]
    for q in (50, 95, 99):
        expected = {d["percentage"]: d["latency"] for d in before["latencyDistribution"]}[q] / 1e6
        assert rows[f"latency P{q}"].before == expected
    assert rows["average"].after == after["average"] / 1e6 and rows["slowest"].before == before["slowest"] / 1e6
    for code, n in after["statusCodeDistribution"].items():
        assert rows[f"status {code}"].after == n and rows[f"status {code}"].before == before["statusCodeDistribution"].get(code, 0)
    assert rows["errors"].after == sum(after["errorDistribution"].values()) and rows["errors"].before == 0
    assert not any(name.startswith("TTFT") for name in rows)  # ghz has no streaming figures

    png = tmp_path / "diff.png"
    assert diff.main([str(GHZ / "greeter_before.json"), str(GHZ / "greeter_after.json"), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"{before['rps']:.2f}" in out and f"{after['rps']:.2f}" in out
    p95 = {d["percentage"]: d["latency"] for d in after["latencyDistribution"]}[95] / 1e6
    assert f"{p95:.2f} ms" in out and "status Internal" in out
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 500


def bench_report(latencies: list[float], ttft: float, errors: int = 0) -> dict:
    """A report from `switchyard bench run`'s own report code, over calls of known latencies."""
    results = [CallResult(number=i, started_at=1.7e9 + i, latency_s=latency, status="OK", error="",
                          priority=("core", "normal", "batch")[i % 3], task_type="chat", ttft_s=ttft + i * 1e-4,
                          tokens=10) for i, latency in enumerate(latencies)]
    results += [CallResult(number=len(results) + i, started_at=1.7e9, latency_s=0.001, status="ResourceExhausted",
                           error="orchestration queue full", priority="batch", task_type="chat") for i in range(errors)]
    load = LoadResult(results=results, wall_s=2.0, cpu_s=0.1, procs=1, end_reason="normal")
    return build_report(load, LoadPlan(host="127.0.0.1:50051", calldata=[{"payload": "hi"}], total=len(results)))


def test_reports_written_by_bench_run_add_ttft_tokens_and_classes(tmp_path, capsys):
    before = bench_report([0.010 + i * 0.001 for i in range(60)], ttft=0.004)
    after = bench_report([0.008 + i * 0.0005 for i in range(60)], ttft=0.003, errors=3)
    paths = []
    for name, report in (("bench_before", before), ("bench_after", after)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    rows = by_name(before, after)
    ttft = {d["percentage"]: d["latency"] for d in after["switchyard"]["ttftDistribution"]}
    assert rows["TTFT P95"].after == ttft[95] / 1e6
    assert rows["tokens/s"].before == before["switchyard"]["tokensPerSecond"]
    core = after["switchyard"]["byPriority"]["core"]
    assert rows["core calls"].after == core["count"] and rows["batch errors"].after == 3
    assert rows["core P95"].after == {d["percentage"]: d["latency"] for d in core["latencyDistribution"]}[95] / 1e6
    assert rows["status ResourceExhausted"].before == 0 and rows["status ResourceExhausted"].after == 3
    assert diff.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "TTFT P99" in out and "core P95" in out and "bench_before" in out
    assert (tmp_path / "bench-diff.png").is_file()  # the default plot, beside AFTER


def test_a_file_that_is_not_a_ghz_report_names_the_file_and_the_key(tmp_path, capsys):
    bad = tmp_path / "locust_stats.json"
    bad.write_text(json.dumps({"requests": 10}))
    assert diff.main([str(bad), str(GHZ / "greeter_after.json"), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "locust_stats.json: not a ghz JSON report: no count" in err
    assert diff.main([str(tmp_path / "missing.json"), str(bad), "--no-plot"]) == 2


def _set(report: dict, path: tuple, value) -> None:
    node = report
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


@pytest.mark.parametrize(("path", "value", "says"), [
    (("rps",), "12.5", "rps: input should be a valid number, got '12.5'"),
    (("count",), "200", "count: input should be a valid number"),
    (("total",), None, "total: input should be a valid number, got None"),
    (("average",), True, "average: input should be a valid number, got True"),
    (("fastest",), float("nan"), "fastest: input should be a finite number"),
    (("slowest",), -1, "slowest: input should be greater than or equal to 0"),
    (("statusCodeDistribution", "OK"), "60", "statusCodeDistribution.OK: input should be a valid number"),
    (("errorDistribution",), ["x"], "errorDistribution: input should be a valid dictionary"),
    (("latencyDistribution", 3, "latency"), "9ms", "latencyDistribution[3].latency: input should be a valid number"),
    (("details", 0, "latency"), "1", "details[0].latency: input should be a valid number"),
    (("switchyard", "tokensPerSecond"), "fast", "switchyard.tokensPerSecond: input should be a valid number"),
    (("switchyard", "ttftDistribution", 2, "latency"), "x", "switchyard.ttftDistribution[2].latency"),
    (("switchyard", "byPriority", "core", "count"), "20", "switchyard.byPriority.core.count: input should be"),
])
def test_a_key_of_the_wrong_type_names_the_file_and_the_key(tmp_path, capsys, path, value, says):
    """Every number diff reads is checked before it prints: a string where a number belongs ends in exit 2
    naming the file and the key, not in a traceback from the table's formatting."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(bench_report([0.010 + i * 0.001 for i in range(60)], ttft=0.004)))
    report = bench_report([0.010 + i * 0.001 for i in range(60)], ttft=0.004)
    _set(report, path, value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(report))
    for argv in ([str(good), str(bad), "--no-plot"], [str(bad), str(good), "--no-plot"]):
        assert diff.main(argv) == 2
        captured = capsys.readouterr()
        assert f"switchyard bench diff: {bad}: {says}" in captured.err and captured.out == ""
    assert diff.main([str(good), str(good), "--no-plot"]) == 0


def test_the_plot_path_printed_is_the_one_written_and_a_folder_is_refused(tmp_path, capsys):
    reports = [str(GHZ / "greeter_before.json"), str(GHZ / "greeter_after.json")]
    assert diff.main([*reports, "--plot", str(tmp_path / "latency")]) == 0  # matplotlib adds .png
    assert (tmp_path / "latency.png").is_file()
    assert f"plot written to {tmp_path / 'latency.png'}" in capsys.readouterr().out
    for where in (tmp_path, tmp_path / "latency.png" / "x.png"):  # a folder; a file where a folder should be
        with pytest.raises(SystemExit) as caught:
            diff.main([*reports, "--plot", str(where)])
        assert caught.value.code == 2 and "--plot: expected a PNG file" in capsys.readouterr().err


def test_a_run_where_every_call_failed_shows_no_latency_not_zero():
    before = json.loads((GHZ / "greeter_before.json").read_text())
    failed = {**before, "average": 0, "fastest": 0, "slowest": 0, "latencyDistribution": None,
              "statusCodeDistribution": {"DeadlineExceeded": before["count"]}}
    shown = by_name(before, failed)
    for key in ("average", "fastest", "slowest", "latency P50"):
        assert shown[key].after is None, key  # "-", as for its percentiles; a change of -82 ms it was
    assert shown["fastest"].before == before["fastest"] / 1e6


def test_a_report_saved_with_a_byte_order_mark_is_read_as_without_it(tmp_path, capsys):
    """An editor's UTF-8 BOM: the report was refused 'not JSON (Unexpected UTF-8 BOM ...)'."""
    bom = tmp_path / "edited.json"
    bom.write_bytes(b"\xef\xbb\xbf" + (GHZ / "greeter_before.json").read_bytes())
    assert diff.main([str(bom), str(GHZ / "greeter_after.json"), "--no-plot"]) == 0


def test_a_report_not_in_utf8_is_named_and_one_in_utf16_is_read(tmp_path, capsys):
    """A stray byte ended in a traceback of UnicodeDecodeError; PowerShell's `ghz ... > r.json` writes UTF-16."""
    text = (GHZ / "greeter_before.json").read_text()
    (tmp_path / "utf16.json").write_bytes(text.encode("utf-16"))
    assert diff.main([str(tmp_path / "utf16.json"), str(GHZ / "greeter_after.json"), "--no-plot"]) == 0
    (tmp_path / "latin1.json").write_bytes(text.replace("{", '{"note": "caf\xe9", ', 1).encode("latin-1"))
    assert diff.main([str(tmp_path / "latin1.json"), str(GHZ / "greeter_after.json"), "--no-plot"]) == 2
    assert f"{tmp_path / 'latin1.json'}: not JSON: expected UTF-8 text (byte 0xE9 at offset" in capsys.readouterr().err


def test_the_classes_are_listed_in_rank_order_then_any_other_by_name():
    before = json.loads((GHZ / "greeter_before.json").read_text())
    classes = {name: {"count": 1, "errors": 0} for name in ("zeta", "batch", "core", "alpha", "normal")}
    report = {**before, "switchyard": {"byPriority": classes}}
    listed = [r.name.removesuffix(" calls") for r in diff.rows(before, report) if r.name.endswith(" calls")]
    assert listed == ["core", "normal", "batch", "alpha", "zeta"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_bench_diff_refuses_a_plot_path_before_printing_the_comparison(tmp_path, capsys):
    """It printed the whole comparison, then 'could not write the plot (No such file or directory)', exit 0."""
    with pytest.raises(SystemExit) as caught:
        diff.main([str(GHZ / "greeter_before.json"), str(GHZ / "greeter_after.json"), "--plot", "/proc/x/d.png"])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert "--plot: expected a PNG file that can be written (cannot make the folder /proc/x" in captured.err
    assert "latency P95" not in captured.out
