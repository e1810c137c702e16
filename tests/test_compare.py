"""`dualflow compare`: the command end to end on a checkpoint folder, and its one-line errors."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import tiny_model

from dualflow.cli import main
from dualflow.instruments.plots import pyplot


STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_TEXT_FILE = STDLIB / "textwrap.py"


def test_compare_cli_on_a_checkpoint_folder(tmp_path, capsys):
    folder = tmp_path / "byte-model"
    tiny_model(vocab_size=256, aux_num_experts_per_tok=4).save_pretrained(folder)  # no tokenizer: byte-level
    out = tmp_path / "report.json"
    argv = ["compare", str(folder), "--data", str(SMALL_TEXT_FILE), "--prompt-lengths", "8,32", "--batch", "1,2"]
    argv += ["--decode-tokens", "2", "--repeats", "1", "--eval-tokens", "64", "--json", str(out)]
    assert main(argv + ["--plot", str(tmp_path / "compare.png")]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == str(folder) and report["settings"]["data"] == [str(SMALL_TEXT_FILE)]
    assert report["settings"]["eval_tokens"] == 64
    printed = capsys.readouterr().out
    assert "single top-k=4" in printed and "two-pass" in printed
    # the plot of this report (tests/test_plots.py checks what the figure shows)
    assert f"wrote {tmp_path / 'compare.png'}" in printed
    assert pyplot().imread(tmp_path / "compare.png").shape[:2] == (462, 1650)


def test_compare_cli_reports_the_decode_cost_of_each_aux_round(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["compare", "--aux-rounds", "2", "--train-steps", "2", "--data", str(SMALL_TEXT_FILE)]
    argv += ["--prompt-lengths", "8", "--batch", "1", "--decode-tokens", "2", "--repeats", "1", "--eval-tokens", "64"]
    assert main(argv + ["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["aux_num_rounds"] == 2 and "dual-flow r1" in report["variants"]
    assert "two-pass" not in report["variants"]  # the two-pass execution walks the layers once for the aux flow
    assert set(report["decode_ms_per_aux_round"]) == {"1"}
    assert "decode time per step added by each aux round after the first: batch 1:" in capsys.readouterr().out


def test_compare_cli_bad_input_is_one_line(tmp_path, capsys):
    folder = tmp_path / "byte-model"
    tiny_model(vocab_size=256).save_pretrained(folder)
    small_vocab = tmp_path / "small-vocab"
    tiny_model().save_pretrained(small_vocab)  # vocab 97 and no tokenizer: nothing to tokenize with
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    cases = [
        ([str(small_vocab)], "has no tokenizer: add the source model's, e.g. AutoTokenizer.from_pretrained(SOURCE)"),
        ([str(folder), "--prompt-lengths", "8,x"], "expected comma-separated integers"),
        ([str(folder), "--prompt-lengths", "4096"], "exceeds max_position_embeddings=128"),
        ([str(folder), "--data", str(tmp_path / "nope.txt")], "--data file not found"),
        ([str(folder), "--aux-rounds", "2"], "--aux-rounds sets the built-in model's rounds"),
        ([str(folder), "--data", str(binary)], f"data file {binary} is not UTF-8 text"),  # as finetune refuses it
        # Outputs are checked before the measurement, not after it.
        ([str(folder), "--json", str(tmp_path)], f"--json {tmp_path} is a folder: give a file name"),
        ([str(folder), "--json", str(tmp_path / "no" / "r.json")], "cannot be written: No such file or directory"),
    ]
    capsys.readouterr()  # save_pretrained's progress bars
    for argv, message in cases:
        assert main(["compare", *argv, "--repeats", "1"]) == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]  # after any weight-loading progress bar
        assert error.startswith("dualflow compare: error: ") and message in error, error


@pytest.mark.parametrize("path", ["no-such-folder", "./no-such-folder", "tests/no-such-folder", "/no/such/folder"])
def test_compare_of_a_local_looking_path_fails_at_once(path):
    # No torch import and no Hub request: the message comes before either.
    code = (
        "import sys\nfrom dualflow.cli import main\nstatus = main(['compare', sys.argv[1]])\n"
        "print(status, 'torch' in sys.modules, 'huggingface_hub' in sys.modules)"
    )
    completed = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300)
    assert completed.stdout.split() == ["2", "False", "False"]
    assert (
        completed.stderr.strip()
        == f"dualflow compare: error: {path} does not exist (a local path; Hub ids look like org/name)"
    )
