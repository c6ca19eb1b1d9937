"""User files read through the bounded reader (issue 63): ``simulate --replay``'s ranks CSV and the
step-time JSONL. A line too long, a field too large, non-UTF-8 text or a bad value is an error naming the
file and the line; the replay says how many rows it read, used and left out, and why."""

from __future__ import annotations

import json

import pytest

from lightning_adaptiveload.cli.simulate import main as simulate_main
from lightning_adaptiveload.shards.textfile import TextFileError, iter_lines, read_csv
from lightning_adaptiveload.tools.step_times import StepTimeTable

HEADER = "rank,batch_idx,batch_size,num_tokens,seq_len,compute_time_s,token_sq_sum\n"


def _ranks_rows(n: int = 44) -> list[str]:
    rows = []
    for i in range(n):
        b, s = (1, 3, 6)[i % 3], (24, 72, 120, 225)[i % 4]
        rows.append(f"{i % 2},{i // 2},{b},{b * s},{s},{0.001 * b * s + 0.01},{b * s * s}\n")
    return rows


def test_a_huge_line_fails_fast_naming_the_file_and_line(tmp_path):
    """Before: a 2 GiB CSV line raised MemoryError at 2.3 GB. Here a 3 MiB line (the cap is 1 MiB)."""
    path = tmp_path / "ranks.csv"
    with open(path, "w") as f:
        f.write(HEADER + "".join(_ranks_rows(3)))
        f.write("0," + "9" * (3 << 20) + "\n")
    with pytest.raises(TextFileError, match=r"ranks\.csv, line 5: longer than 1048576 bytes"):
        read_csv(path)
    with pytest.raises(TextFileError, match="line 1: longer than 10 bytes"):
        list(iter_lines(path, max_line=10))
    lines = iter_lines(path, max_line=100)
    assert [next(lines)[0] for _ in range(4)] == [1, 2, 3, 4]  # the lines under the cap are read
    with pytest.raises(TextFileError, match="line 5: longer than 100 bytes"):
        next(lines)


def test_a_large_field_and_non_utf8_name_the_file_and_line(tmp_path, capsys):
    """Before: a 1 MiB quoted field escaped as a bare ``_csv.Error``; a non-UTF-8 file as a codec error."""
    path = tmp_path / "ranks.csv"
    big = '"' + "x" * 300_000 + "\n" + "y" * 300_000 + '"'  # over the field limit, each line under the cap
    path.write_text(HEADER + "".join(_ranks_rows(2)) + f"0,{big},1,1,1,1,1\n")
    with pytest.raises(TextFileError, match=r"ranks\.csv, line \d+: not readable as CSV \(field larger"):
        read_csv(path)
    assert simulate_main(["--replay", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "not readable as CSV" in capsys.readouterr().err
    raw = tmp_path / "latin.csv"
    raw.write_bytes(HEADER.encode() + "".join(_ranks_rows(2)).encode() + b"0,1,1,24,24,0.1,\xe9\n")
    assert simulate_main(["--replay", str(raw), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "latin.csv, line 4: not UTF-8 text" in err


def test_a_fifo_is_refused_without_waiting(tmp_path):
    import os

    fifo = tmp_path / "ranks.csv"
    os.mkfifo(fifo)
    with pytest.raises(TextFileError, match="is a FIFO"):
        read_csv(fifo)


def test_replay_counts_every_row(tmp_path, capsys):
    """Before: bad cells became NaN and rows were dropped without a count (27 or 19 of 44 reported)."""
    rows = _ranks_rows(44)
    cells = rows[3].split(",")
    cells[4] = "abc"  # a seq_len that is not a number
    rows[3] = ",".join(cells)
    cells = rows[7].split(",")
    cells[5] = "nan"
    rows[7] = ",".join(cells)
    cells = rows[9].split(",")
    cells[5] = "-1"
    rows[9] = ",".join(cells)
    path = tmp_path / "ranks.csv"
    path.write_text(HEADER + "".join(rows))
    out = tmp_path / "out"
    assert simulate_main(["--replay", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((out / "replay.json").read_text())["rows"]
    assert saved["read"] == 44 and saved["unaccounted"] == 0
    assert saved["used"] + saved["outliers"] + saved["warmup"] + sum(saved["dropped"].values()) == 44
    assert saved["dropped"].get("negative_time") == 1  # the nan row may fall in a warm-up step instead
    assert saved["bad_cells"]["compute_time_s"] == 1 and saved["bad_cell_lines"]["compute_time_s"] == [9]
    assert saved["bad_cells"]["seq_len"] == 1 and saved["bad_cell_lines"]["seq_len"] == [5]
    assert "rows: 44 read" in printed and "seq_len 1 (lines 5)" in printed


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"T": [1], "H": 4, "W": 4, "B": 1, "ms": 5}', "line 2: T, H, W, B must be whole numbers"),
        ('{"T": 1e400, "H": 4, "W": 4, "B": 1, "ms": 5}', "line 2: T, H, W, B must be whole numbers"),
        ('{"T": 1, "H": 4, "W": 4, "B": 1, "ms": "x"}', "line 2: T, H, W, B must be whole numbers"),
        (
            '{"T": 1, "H": 4, "W": 4, "B": 1, "ms": 5, "peak_gb": {}}',
            "line 2: T, H, W, B must be whole numbers",
        ),
        ('{"T": 1, "H": 4, "W": 4, "B": 1, "ms": 5, "peak_gb": -1}', "line 2: peak_gb=-1"),
        ('{"T": true, "H": 4, "W": 4, "B": 1, "ms": 5}', "line 2: T, H, W, B must be whole numbers"),
    ],
)
def test_step_table_bad_values_name_the_file_and_line(tmp_path, line, words):
    """Before: TypeError and OverflowError escaped, naming neither file nor line."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"T": 1, "H": 4, "W": 4, "B": 1, "ms": 5}\n' + line + "\n")
    with pytest.raises(ValueError) as err:
        StepTimeTable.from_jsonl(path)
    assert f"step time trace {path}" in str(err.value) and words in str(err.value), str(err.value)


def test_step_table_non_utf8_and_long_lines(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b'{"T": 1, "H": 4, "W": 4, "B": 1, "ms": 5}\n# caf\xe9\n')
    with pytest.raises(TextFileError, match=r"trace\.jsonl, line 2: not UTF-8"):
        StepTimeTable.from_jsonl(path)
    path.write_text('{"T": 1, "H": 4, "W": 4, "B": 1, "ms": 5, "pad": "' + "x" * (2 << 20) + '"}\n')
    with pytest.raises(TextFileError, match="line 1: longer than"):
        StepTimeTable.from_jsonl(path)
    path.write_text(
        '{"T": 1, "H": 4, "W": 4, "B": 2, "ms": 5.0}\n{"T": 1.0, "H": 4, "W": 4, "B": 2, "ms": 7}\n'
    )
    table = StepTimeTable.from_jsonl(path)
    assert table.seconds == {(1, 4, 4): {2: pytest.approx(0.006)}}
