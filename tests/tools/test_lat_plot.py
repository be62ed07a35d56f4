"""`lat --plot PNG` (docs/command-line.md: lat): what is plotted is the run's own samples with the table's figures
(`distributions`, tested apart from the drawing), the PNG it writes, and what it refuses before any NIC boots."""
import json
import subprocess
import sys

import pytest

from aiofabric.tools import cli, lat_plot, plot
from aiofabric.tools.samples import summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_each_sizes_samples_sorted_with_the_tables_figures_by_size():
    measured = {64: [5.0, 1.0, 3.0, 2.0, 4.0, 9.0, 8.0], 2: [0.5]}
    first, second = lat_plot.distributions(measured)
    assert (first.size, first.samples, first.slower()) == (2, [0.5], [1.0])
    assert first.marks == {"min": 0.5, "typical": 0.5, "99%": 0.5, "99.9%": 0.5, "max": 0.5}
    assert second.size == 64 and second.samples == [1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 9.0]
    figures = summarize(measured[64])  # the two largest are left out, as perftest does: t_max is the next one
    assert second.marks == {"min": figures["t_min_us"], "typical": figures["t_typical_us"], "99%": figures["p99_us"],
                            "99.9%": figures["p99_9_us"], "max": figures["t_max_us"]}
    assert (second.marks["min"], second.marks["typical"], second.marks["max"]) == (1.0, 3.0, 8.0)
    assert second.slower() == [7 / 7, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7]


def test_cycles_scale_samples_and_figures_alike_and_no_samples_is_refused():
    [scaled] = lat_plot.distributions({8: [2.0, 1.0]}, scale=1000.0)  # -C at 1000 MHz: cycles
    assert scaled.samples == [1000.0, 2000.0] and scaled.marks["min"] == 1000.0 and scaled.marks["max"] == 2000.0
    with pytest.raises(ValueError, match=r"^size 8: no samples to plot$"):
        lat_plot.distributions({8: []})
    with pytest.raises(ValueError, match=r"^no samples to plot$"):
        lat_plot.distributions({})


def test_where_the_plot_cannot_go_is_said_before_the_run(tmp_path):
    assert plot.check_path(str(tmp_path / "lat.png")) is None
    assert plot.check_path("lat.png") is None  # the working directory
    assert plot.check_path(f"{tmp_path}/no/lat.png") == f"--plot {tmp_path}/no/lat.png: there is no directory " \
                                                            f"{tmp_path}/no"
    assert plot.check_path(str(tmp_path)) == f"--plot {tmp_path}: is a directory; name a PNG file"


@pytest.mark.parametrize("measured", [{2: [3.0, 1.0, 2.0] * 50}, {2: [1.0, 1.5], 4096: [2.0, 7.0, 3.0]},
                                      {2: [4.0]}], ids=["one-size", "sweep", "one-sample"])
def test_draw_writes_a_png_whatever_the_suffix(tmp_path, measured):
    pytest.importorskip("matplotlib")
    path = tmp_path / "lat.out"
    lat_plot.draw(lat_plot.distributions(measured), str(path), title="t")
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def run_capturing(monkeypatch, capsys, argv):
    """`aiofabric lat ...` in this process; what it asked to draw, and its JSON."""
    drawn = []
    draw = lat_plot.draw

    def drawing(data, path, unit="usec", title=""):
        drawn.append((data, path, unit))
        draw(data, path, unit, title)
    monkeypatch.setattr(lat_plot, "draw", drawing)
    code = cli.main([*argv, "--json"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 0 and result["ok"], result
    return drawn, result


def test_lat_plots_the_runs_own_samples_and_writes_a_png(tmp_path, monkeypatch, capsys):
    png = tmp_path / "lat.png"
    drawn, result = run_capturing(monkeypatch, capsys, ["lat", "write", "-n", "40", "-U", "--plot", str(png)])
    [(data, path, unit)] = drawn
    [plotted] = data
    assert (path, unit, plotted.size) == (str(png), "usec", 2)
    assert plotted.samples == sorted(result["samples"]) and len(plotted.samples) == 40  # -U lists them as measured
    assert plotted.marks["min"] == result["t_min_us"] and plotted.marks["99%"] == result["p99_us"]
    assert plotted.marks["typical"] == result["t_typical_us"] and plotted.marks["max"] == result["t_max_us"]
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 1000


def test_lat_plots_a_sweep_size_by_size_without_adding_samples_to_the_json(tmp_path, monkeypatch, capsys):
    png = tmp_path / "sweep.png"
    drawn, result = run_capturing(monkeypatch, capsys, ["lat", "send", "-a", "-n", "3", "--plot", str(png)])
    [(data, _, _)] = drawn
    assert [item.size for item in data] == [row["size"] for row in result["rows"]] == [2 ** k for k in range(1, 24)]
    for item, row in zip(data, result["rows"]):
        assert len(item.samples) == 3 and item.marks["min"] == row["t_min_us"] and "samples" not in row
    assert png.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("argv,message", [
    (["--server"], "--plot: the client's options"),
    (["--plot", "/nonexistent/dir/lat.png"], "--plot /nonexistent/dir/lat.png: there is no directory /nonexistent/dir"),
], ids=["server", "no-directory"])
def test_lat_plot_refuses_what_cannot_work_before_the_run(capsys, argv, message):
    argv = ["lat", "write", *argv] + ([] if "--plot" in argv else ["--plot", "x.png"])
    code = cli.main([*argv, "--json"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 2 and result["ok"] is False and message in result["error"], result


def test_lat_plot_without_matplotlib_names_the_extra_before_running():
    hide = "import sys; sys.modules['matplotlib'] = None; from aiofabric.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.run([sys.executable, "-c", hide, "lat", "write", "-n", "1000000", "--plot", "never.png",
                              "--json"], capture_output=True, text=True, timeout=60)  # a run would outlast this
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert process.returncode == 1 and "pip install 'aiofabric[plot]'" in result["error"]
    assert "fw_version" not in result  # refused before any NIC booted


@pytest.mark.parametrize("where,message", [
    ("/nonexistent/dir/bw.png", "--plot /nonexistent/dir/bw.png: there is no directory /nonexistent/dir"),
    (".", "--plot .: is a directory; name a PNG file"),
], ids=["no-directory", "a-directory"])
def test_bench_plot_refuses_a_path_it_cannot_write_before_the_run(capsys, where, message):
    code = cli.main(["bench", "write", "-a", "--plot", where, "--json"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 2 and result["ok"] is False and message in result["error"], result


def test_a_failed_run_reports_its_own_error_and_draws_nothing(tmp_path, capsys):
    """No size finished, so nothing is plotted; the JSON line and the exit status are the run's failure."""
    png = tmp_path / "lat.png"
    code = cli.main(["lat", "write", "127.0.0.1", "-p", "9", "-n", "10", "--plot", str(png), "--json"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 1 and result["error"] == ("PeerError: no aiofabric server (bench or lat --server) at 127.0.0.1:9 "
                                             "(connection refused)")
    assert not png.exists()
