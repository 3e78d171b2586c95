#!/usr/bin/env bash
# Kyutai's Moshi client (python -m moshi.client) in its own venv, .venv-moshi, plus PulseAudio for headless sound.
# Its own pins would pull a multi-GB torch, so the wheel goes in with --no-deps and its small deps are named here
# (the list shared/TESTING-NOTES.md checked). Idempotent. tests/test_moshi_client.py skips, saying so, without it.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v pulseaudio >/dev/null; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        libportaudio2 pulseaudio pulseaudio-utils libasound2-plugins >/dev/null \
        || echo "setup: could not install PulseAudio; the Moshi client test will skip" >&2
fi

py=.venv-moshi/bin/python
if ! { [ -x $py ] && $py -c "import moshi.client" 2>/dev/null; }; then
    [ -x $py ] || python3 -m venv .venv-moshi
    $py -m pip install -q torch==2.13.0
    wheels=$(mktemp -d)
    $py -m pip download -q --no-deps -d "$wheels" moshi==0.2.13
    $py -m pip install -q --no-deps "$wheels"/moshi-*.whl
    $py -m pip install -q 'numpy<2.3,>=1.26' 'sounddevice==0.5' 'sphn<0.3.0,>=0.2.0' 'aiohttp<3.12,>=3.10.5' \
        'safetensors<0.8.0,>=0.4.0' 'huggingface-hub<1.0.0,>=0.24' 'einops<0.9,>=0.7' 'sentencepiece<0.3,>=0.2.0' \
        'tqdm>=4.48' 2>&1 | grep -v -e "dependency resolver" -e "moshi 0.2.13 requires" || true
    rm -rf "$wheels"
fi
