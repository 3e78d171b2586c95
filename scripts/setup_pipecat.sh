#!/usr/bin/env bash
# pipecat (pipecat-ai[openai] 1.14.0) in its own venv, .venv-pipecat: about 0.5 GB (onnxruntime, numba) that the
# project itself does not need, and no torch. Idempotent. tests/test_pipecat.py skips, saying so, without it.
set -euo pipefail
cd "$(dirname "$0")/.."

py=.venv-pipecat/bin/python
if ! { [ -x $py ] && $py -c "import pipecat.services.openai.realtime.llm" 2>/dev/null; }; then
    [ -x $py ] || python3 -m venv .venv-pipecat
    $py -m pip install -q "pipecat-ai[openai]==1.14.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
