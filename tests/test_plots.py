"""plots: compare's figure shows the report's numbers; without matplotlib a one-line error naming the extra."""

import subprocess
import sys

import pytest

from dualflow.instruments.plots import compare_figure, plot_compare, pyplot


plt = pyplot()
# A report as `compare_report` writes it (tests/test_measure.py checks that schema), with numbers the test can find.
REPORT = {
    "model": "tiny-model",
    "device": "cpu",
    "dtype": "float32",
    "metrics": {
        "primary-only": {
            "prefill_ms": {"8": 1.5, "64": 4.0, "512": 30.0},
            "decode_tokens_per_s": {"1": 100.0, "4": 350.0},
            "val_loss": 3.25,
        },
        "dual-flow": {
            "prefill_ms": {"8": 1.6, "64": 4.2, "512": 31.0},
            "decode_tokens_per_s": {"1": 80.0, "4": 270.0},
            "val_loss": 3.0,
        },
    },
}


@pytest.fixture
def figure():
    fig = compare_figure(REPORT)
    yield fig
    plt.close(fig)


def series(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_compare_figure_plots_every_variant_on_its_axes(figure):
    prefill, decode, loss = figure.axes
    assert series(prefill) == {
        "primary-only": ([8, 64, 512], [1.5, 4.0, 30.0]),
        "dual-flow": ([8, 64, 512], [1.6, 4.2, 31.0]),
    }
    assert series(decode) == {"primary-only": ([1, 4], [100.0, 350.0]), "dual-flow": ([1, 4], [80.0, 270.0])}
    assert [text.get_text() for text in prefill.get_legend().get_texts()] == ["primary-only", "dual-flow"]
    assert (prefill.get_xscale(), decode.get_xscale()) == ("log", "log")
    assert [label.get_text() for label in prefill.get_xticklabels()] == ["8", "64", "512"]
    assert [label.get_text() for label in decode.get_xticklabels()] == ["1", "4"]
    assert prefill.get_xlabel() == "prompt length (tokens)" and decode.get_xlabel() == "batch size"
    assert prefill.get_ylabel() == "prefill latency (ms, median)"
    assert decode.get_ylabel() == "decode tokens/s (median)"
    # one bar per variant, its height the variant's loss, every bar's top inside the visible range
    assert [bar.get_height() for bar in loss.patches] == [3.25, 3.0]
    assert [label.get_text() for label in loss.get_xticklabels()] == ["primary-only", "dual-flow"]
    low, high = loss.get_ylim()
    assert low < 3.0 and 3.25 < high
    assert figure.get_suptitle() == "dualflow compare: tiny-model (cpu, float32)"


def test_plot_compare_writes_the_figure_as_a_png(tmp_path):
    plot_compare(REPORT, tmp_path / "compare.png")
    assert plt.imread(tmp_path / "compare.png").shape[:2] == (462, 1650)  # 15 x 4.2 inches at 110 dpi
    assert plt.get_fignums() == []  # closed: a long `experiment` run does not pile up figures


def test_without_matplotlib_the_error_names_the_extra():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
        "from dualflow.cli import main\n"
        "sys.exit(main(['compare', '--plot', 'x.png']))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        "dualflow compare: error: plots need matplotlib: pip install 'dualflow-transformers[instruments]' "
        "(or pip install matplotlib)"
    )
