#!/usr/bin/env bash
# A newcomer's run, measured: a fresh clone of this checkout's HEAD, empty pip,
# uv, torch-extension, TorchInductor and Triton caches, no venvs (so no JAX,
# TensorFlow or mypy caches either: they live in and beside the venvs), then
# the README's command, `pip install "nox[uv]" && nox`. Prints the wall time
# and the disk it leaves (venvs and caches, uv's hard links counted once).
# Everything lives under one scratch folder (the first argument, else a new
# temporary one): delete it after.
set -uo pipefail
scratch="${1:-$(mktemp -d)}"
mkdir -p "$scratch"
git clone -q "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" "$scratch/qhoptim"
cd "$scratch/qhoptim"
export PIP_CACHE_DIR="$scratch/cache/pip" UV_CACHE_DIR="$scratch/cache/uv"
export TORCH_EXTENSIONS_DIR="$scratch/cache/torch_extensions"
export TRITON_CACHE_DIR="$scratch/cache/triton" XDG_CACHE_HOME="$scratch/cache/xdg"
export TORCHINDUCTOR_CACHE_DIR="$scratch/cache/inductor"
unset QHOPTIM_NOX_ENVDIR
python3.11 -m venv "$scratch/venv"
start=$(date +%s)
"$scratch/venv/bin/pip" install -q "nox[uv]"
PATH="$scratch/venv/bin:$PATH" nox
status=$?
echo "nox exited $status after $(($(date +%s) - start)) s (pip install included)"
du -sbc .nox "$scratch/cache" | tail -1
exit "$status"
