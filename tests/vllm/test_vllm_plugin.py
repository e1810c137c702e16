"""The plugin is found through vLLM's entry point group, and importing the package does not import vLLM."""

import subprocess
import sys
from importlib.metadata import entry_points


def test_entry_point_registers_the_model():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("dualflow") == "dualflow.serving:register"


def test_importing_the_package_does_not_import_vllm():
    code = "import sys, dualflow, dualflow.serving, modeling_dualflow; print('vllm' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
