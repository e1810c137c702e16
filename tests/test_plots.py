"""plots: compare's PNG; without matplotlib a one-line error naming the extra."""

import subprocess
import sys

import torch
from helpers import tiny_model

from dualflow.instruments.measure import CompareSettings, compare_report
from dualflow.instruments.plots import plot_compare


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_compare_writes_a_png(tmp_path):
    model = tiny_model(aux_num_experts_per_tok=3)
    tokens = torch.randint(0, model.config.vocab_size, (200,))
    settings = CompareSettings(prompt_lengths=(8, 16), batch_sizes=(1, 2), decode_tokens=2, repeats=1, eval_blocks=1)
    plot_compare(compare_report(model, "tiny", ["random"], tokens, settings, show_progress=False), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC


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
