#!/usr/bin/env bash
# Set up .venv with the project, its dev tools and what benchmarks and tests need besides (the `bench` extra).
# Idempotent: a second run only checks.
# Without an NVIDIA GPU, torch is the 2.13.0 CPU build that lies on local disk (any other version is a huge download).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=""
    command -v espeak-ng >/dev/null || missing="$missing espeak-ng"
    command -v sox >/dev/null || missing="$missing sox"
    command -v chromium >/dev/null || missing="$missing chromium"
    command -v haproxy >/dev/null || missing="$missing haproxy"
    command -v flite >/dev/null || missing="$missing flite"  # flite and festival: training voices (s2s train)
    command -v text2wave >/dev/null || missing="$missing festival festvox-us-slt-hts"
    ldconfig -p | grep libopus.so.0 >/dev/null || missing="$missing libopus0"  # the server's Opus encoder (server/moshi/ogg_opus.py)
    if [ -n "$missing" ]; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null \
            || echo "setup: could not install$missing; tests fall back to the speech sample, the cluster's skip" >&2
    fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
if ! $py -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        $py -m pip install -q torch
    else
        $py -m pip install -q torch==2.13.0
    fi
fi
$py -m pip install -q -e '.[dev,bench]' 2>&1 | grep -v "^WARNING: Location" || true
$py -c "from codec import EncodecTokenizer; from s2s import Engine" # fails loudly if the install did not take
# Without CUDA, compile the C++ CPU attention kernel now (about a minute, once per .venv), not in the first model step: an engine
# stalled on the compiler answers nobody, and a test or the demo waiting on it would time out.
$py -c "import torch; from paged_kernels import cpu_attention; torch.cuda.is_available() or cpu_attention.available()"
bash scripts/setup_moshi_client.sh || echo "setup: the Moshi client did not install; tests/test_moshi_client.py will skip" >&2
bash scripts/setup_pipecat.sh || echo "setup: pipecat did not install; tests/test_pipecat.py will skip" >&2
