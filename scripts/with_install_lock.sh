#!/usr/bin/env bash
# Run a command (an editable pip install of this folder) holding the folder's install lock: the install writes the
# package's egg-info here, so two virtual environments set up side by side (.ci/run does) take turns at that step.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -c '
import fcntl, subprocess, sys
with open("pyproject.toml") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    sys.exit(subprocess.call(sys.argv[1:]))
' "$@"
