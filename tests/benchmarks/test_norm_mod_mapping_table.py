"""``benchmarks/kernels/norm_mod_mapping_table.py`` puts the runs of several binaries side by side (no timing
is checked: the rows come from text written here)."""

import pytest
from _paths import ROOT

BENCH = str(ROOT / "benchmarks" / "kernels")

_RUN = """device NVIDIA H200, 132 SMs, L2 60 MB
shape                    op         variant                           ms    %copy check / plan
1x32760x1536 sample      copy       cudaMemcpyAsync               {copy:.4f}   100.0% 4.00 TB/s
1x32760x1536 sample      ln fwd     v4                            {v4:.4f}    85.0% reference; plan tma 0
1x32760x1536 sample      ln bwd     auto (launcher)               {bwd:.4f}    80.0% reference; plan thr 192
not a row at all
"""


@pytest.fixture(scope="module")
def table_tool():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(BENCH)
        import norm_mod_mapping_table

        yield norm_mod_mapping_table


def test_runs_of_two_binaries_line_up_by_shape_op_and_variant(table_tool, tmp_path):
    for name, base in (("nm_a", 0.05), ("nm_b", 0.04)):
        for run in (1, 2):
            text = _RUN.format(copy=base, v4=base + 0.01 * run, bwd=base * 2)
            (tmp_path / f"{name}_run{run}.txt").write_text(text)
    table, bins = table_tool.read_runs(tmp_path)
    assert bins == ["nm_a", "nm_b"]
    assert set(table) == {
        ("1x32760x1536 sample", "copy", "cudaMemcpyAsync"),
        ("1x32760x1536 sample", "ln fwd", "v4"),
        ("1x32760x1536 sample", "ln bwd", "auto (launcher)"),
    }
    assert table[("1x32760x1536 sample", "ln fwd", "v4")]["nm_b"] == {"1": 0.05, "2": 0.06}
    text = table_tool.render(table, ["nm_b", "nm_a"], match="fwd")
    lines = text.splitlines()
    assert len(lines) == 2 and lines[0].split()[-2:] == ["nm_b", "nm_a"]
    assert lines[1].split()[-2:] == ["0.0500/0.0600", "0.0600/0.0700"]
    # A binary without a run shows a dash instead of a number.
    assert table_tool.render(table, ["nm_a", "nm_c"], match="copy").splitlines()[1].split()[-1] == "-/-"
