"""``benchmarks/balance/gpu_clocks_summary.py``: per-GPU busy clocks, power and clock event reasons from an
``nvidia-smi`` log, on small fabricated logs (two GPUs, idle and power-capped samples, damaged lines)."""

from __future__ import annotations

import gzip
import json
import math
import sys

import pytest
from _paths import ROOT

HEADER = "timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active"
LIMITS = (
    "power.limit [W], clocks.max.sm [MHz], clocks.applications.graphics [MHz]\n"
    "700.00 W, 1980 MHz, 1980 MHz\n700.00 W, 1980 MHz, 1980 MHz\n"
)
# (gpu, SM MHz, W, deg C, utilization %, reasons); None is written as [N/A]. Busy (>= 90%): GPU 0 has four
# samples at 1980, 1700, 1600 and 1720 MHz (mean 1750, population std sqrt(19700)), three of them capped (0x4;
# one also SW thermal, 0x20), one power [N/A]; GPU 1 has two at 1500 MHz, both capped. 89% is not busy, nor is
# an [N/A] utilization.
SAMPLES = [
    (0, 345, 80.0, 38, 0, 0x1),
    (1, 345, 79.0, 40, 0, 0x1),
    (0, 1980, 600.0, 50, 100, 0x0),
    (1, 1500, 700.0, 70, 100, 0x4),
    (0, 1700, 700.0, 55, 95, 0x4),
    (1, 1500, 690.0, 72, 100, 0x4),
    (0, 1600, 700.0, 60, 90, 0x4),
    (1, 1900, 650.0, 71, None, 0x4),
    (0, 1720, None, 58, 99, 0x24),
    (0, 1980, 300.0, 45, 89, 0x0),
]
GPU0_STD = math.sqrt(19700.0)


def _line(n: int, gpu: int, sm, w, temp, util, reasons, with_reasons: bool = True) -> str:
    na = "[N/A]"
    cells = [
        f"2026/11/28 21:47:{1 + n // 4:02d}.{250 * (n % 4):03d}",
        str(gpu),
        f"{sm} MHz",
        "3201 MHz",
        na if w is None else f"{w:.2f} W",
        str(temp),
        na if util is None else f"{util} %",
    ]
    if with_reasons:
        cells.append(f"0x{reasons:016x}")
    return ", ".join(cells)


def _log_text(with_reasons: bool = True) -> str:
    header = HEADER if with_reasons else HEADER.rsplit(",", 1)[0]
    lines = [header]
    for n, s in enumerate(SAMPLES):
        lines.append(_line(n, *s, with_reasons=with_reasons))
        if n == 3:
            lines.append("")  # a blank line
            lines.append("2026/11/28 21:47:02.000, 1, 17")  # a logger killed mid-line
    return "\n".join(lines) + "\n"


@pytest.fixture
def gcs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "balance"))
    import gpu_clocks_summary

    return gpu_clocks_summary


@pytest.fixture
def files(tmp_path):
    log = tmp_path / "gpu_clocks.csv"
    log.write_text(_log_text())
    limits = tmp_path / "gpu_limits.txt"
    limits.write_text(LIMITS)
    return log, limits


def test_busy_statistics_reasons_and_damaged_lines_are_exact(gcs, files):
    log, limits = files
    parsed = gcs.parse_log(str(log))
    assert (parsed.lines, parsed.blank, parsed.garbled) == (12, 1, 1)
    assert parsed.na == {"power": 1, "util": 1}
    assert parsed.has_reasons and sorted(parsed.gpus) == [0, 1]
    summary = gcs.summarize(parsed, 90.0, gcs.parse_limits(str(limits)))
    assert summary["file"]["max_sm_mhz"] == 1980
    assert summary["file"]["duration_s"] == pytest.approx(2.25)

    g0 = summary["gpus"][0]
    assert (g0["samples"], g0["busy_samples"]) == (6, 4)
    sm = g0["sm_mhz"]
    assert sm["mean"] == pytest.approx(1750.0)
    assert sm["std"] == pytest.approx(GPU0_STD)
    assert sm["std_share"] == pytest.approx(GPU0_STD / 1750.0)
    assert (sm["min"], sm["p50"], sm["max"]) == (1600, 1710, 1980)
    assert sm["p5"] == pytest.approx(1600 + 0.15 * 100)  # numpy's linear percentile: 5% of 3 gaps = 0.15
    assert g0["at_file_max_sm"] == pytest.approx(0.25)
    assert g0["sm_mean_share_of_max"] == pytest.approx(1750 / 1980)
    assert g0["power_w"]["mean"] == pytest.approx(2000 / 3)  # the [N/A] power left out
    assert g0["power_w"]["max"] == 700
    assert g0["power_share_of_limit"]["mean"] == pytest.approx(2000 / 3 / 700)
    assert g0["temperature_c"] == {"min": 50, "max": 60}
    r0 = g0["reasons"]
    assert r0["SW power cap"] == pytest.approx(0.75)
    assert r0["SW thermal slowdown"] == pytest.approx(0.25)
    assert r0["none"] == pytest.approx(0.25)
    assert r0["GPU idle"] == 0 and r0["HW power brake slowdown"] == 0 and r0["other bits"] == 0

    g1 = summary["gpus"][1]
    assert (g1["samples"], g1["busy_samples"]) == (4, 2)  # the [N/A] utilization is not busy
    assert g1["sm_mhz"]["mean"] == 1500 and g1["sm_mhz"]["std"] == 0
    assert g1["reasons"]["SW power cap"] == 1.0 and g1["at_file_max_sm"] == 0

    assert summary["verdicts"][0] == (
        "power-capped in 75% of busy samples; SM clock 1750 MHz mean (88% of max), std 8.0%; "
        "power 667 W mean (95% of limit); SW thermal slowdown in 25%"
    )
    assert summary["verdicts"][1].startswith("power-capped in 100% of busy samples; SM clock 1500 MHz mean")
    assert "a 16.7% gap" in summary["across_gpus"]


def test_busy_threshold_is_a_setting(gcs, files):
    summary = gcs.summarize(gcs.parse_log(str(files[0])), 80.0)
    assert summary["gpus"][0]["busy_samples"] == 5  # 89% counts now
    assert summary["gpus"][0]["max_sm_source"] == "file"
    assert "of the file's max" in summary["verdicts"][0]
    assert gcs.summarize(gcs.parse_log(str(files[0])), 101.0)["verdicts"][0].startswith("no busy samples")


def test_main_prints_the_table_and_verdicts_and_writes_json(gcs, files, tmp_path, capsys):
    log, limits = files
    out = tmp_path / "sub" / "summary.json"
    assert gcs.main([str(log), "--limits", str(limits), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 GPU(s)" in text and "1 blank, 1 garbled" in text
    assert "GPU 0: power-capped in 75% of busy samples" in text
    assert "SW power cap 75.0%" in text
    payload = json.loads(out.read_text())
    assert payload["input"] == "gpu_clocks.csv"
    assert payload["settings"]["busy_util_pct"] == 90.0 and payload["settings"]["limits"] == "gpu_limits.txt"
    assert payload["date"][:2] == "20"
    assert payload["file"]["garbled_lines"] == 1 and payload["file"]["blank_lines"] == 1
    assert payload["gpus"]["0"]["sm_mhz"]["mean"] == pytest.approx(1750.0)
    assert payload["gpus"]["1"]["reasons"]["SW power cap"] == 1.0
    assert payload["verdicts"]["0"].startswith("power-capped in 75%")


def test_gzip_input_gives_the_same_summary(gcs, files, tmp_path):
    gz = tmp_path / "gpu_clocks.csv.gz"
    with gzip.open(gz, "wt") as f:
        f.write(_log_text())
    plain = gcs.summarize(gcs.parse_log(str(files[0])), 90.0)
    assert gcs.summarize(gcs.parse_log(str(gz)), 90.0) == plain


def test_a_log_without_the_reasons_column(gcs, tmp_path):
    log = tmp_path / "old.csv"
    log.write_text(_log_text(with_reasons=False))
    parsed = gcs.parse_log(str(log))
    assert not parsed.has_reasons and parsed.garbled == 1
    summary = gcs.summarize(parsed, 90.0)
    assert summary["gpus"][0]["sm_mhz"]["mean"] == pytest.approx(1750.0)
    assert summary["gpus"][0]["reasons"] is None
    assert summary["verdicts"][0].startswith("clock event reasons not logged; SM clock 1750 MHz mean")


def test_nvidia_smi_header_with_units(gcs, tmp_path):
    log = tmp_path / "units.csv"
    log.write_text(
        "timestamp, index, clocks.current.sm [MHz], power.draw [W], utilization.gpu [%], "
        "clocks_throttle_reasons.active\n"
        "2026/11/28 21:47:01.681, 0, 1700 MHz, 690.00 W, 100 %, 0x0000000000000004\n"
    )
    summary = gcs.summarize(gcs.parse_log(str(log)), 90.0)
    assert summary["gpus"][0]["sm_mhz"]["mean"] == 1700
    assert summary["gpus"][0]["reasons"]["SW power cap"] == 1.0


@pytest.mark.parametrize("content", [None, "", "\n\n", HEADER + "\n", "a,b,c\n1,2,3\n"])
def test_missing_empty_or_unusable_file_is_a_clear_error(gcs, tmp_path, capsys, content):
    path = tmp_path / "clocks_here.csv"
    if content is not None:
        path.write_text(content)
    assert gcs.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "clocks_here.csv" in err and err.startswith("error: ")


def test_missing_limits_file_is_a_clear_error(gcs, files, tmp_path, capsys):
    assert gcs.main([str(files[0]), "--limits", str(tmp_path / "no_limits.txt")]) == 2
    assert "no_limits.txt: no such file" in capsys.readouterr().err


def test_shares_never_round_to_all_or_nothing(gcs):
    assert gcs._pct(0.995) == "99.5%" and gcs._pct(0.0004) == "0.0%" and gcs._pct(1.0) == "100%"
    assert gcs._pct(0.0) == "0%" and gcs._pct(0.874) == "87%" and gcs._pct(None) == "-"


def test_plot_or_a_clear_message_without_matplotlib(gcs, files, tmp_path, capsys, monkeypatch):
    png = tmp_path / "clocks.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert gcs.main([str(files[0]), "--plot", str(png)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out and not png.exists()
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "balance"))
    assert gcs.main([str(files[0]), "--limits", str(files[1]), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
