#!/usr/bin/env bash
# The project's virtual environment, made (or brought up to date) by `make` before any target.
#
#   bash tools/setup-venv.sh [VENV_DIR]      (default .venv)
#
# A stamp inside the venv records what it was installed from (pyproject.toml's hash, the
# Python, the torch build); when it matches, this returns at once. Otherwise it installs:
#   1. a Python >= 3.10 ($PYTHON, default python3)
#   2. the venv itself
#   3. torch: the CPU build where no NVIDIA GPU answers (`nvidia-smi -L`), so that pip does not
#      pull several GB of CUDA wheels; the default build where one does ($TORCH_SPEC pins it)
#   4. the project, editable, with its test and Hugging Face extras
# A failed step stops with a message naming it, and leaves nothing the next run would trust:
# the stamp is written last, and a venv this run created is removed again.
set -uo pipefail

venv=${1:-.venv}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
cpu_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
cd "$(dirname "$0")/.."

fail() {  # step, message
    echo "make: setting up $venv failed at step $1: $2" >&2
    if [ "${created:-0}" = 1 ]; then
        rm -rf "$venv"
        echo "make: removed the half-made $venv; fix the cause and run make again" >&2
    else
        rm -f "$venv/.installed"
        echo "make: $venv is marked not installed; fix the cause and run make again" >&2
    fi
    exit 1
}

if ! version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    fail "1/4 (find Python)" "'$python' does not run; install Python >= 3.10 or set PYTHON=/path/to/python3"
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    fail "1/4 (find Python)" "'$python' is Python $version; the project needs >= 3.10: set PYTHON=python3.11 (or another >= 3.10)"
fi

if nvidia-smi -L >/dev/null 2>&1; then
    build="default (an NVIDIA GPU answers)"
    torch_args=("$torch_spec")
else
    build="cpu (no NVIDIA GPU answers)"
    torch_args=("$torch_spec")
fi

key="$(sha256sum pyproject.toml | cut -d' ' -f1) python $version torch $torch_spec $build"
if [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$key" ] && [ -x "$venv/bin/python" ]; then
    exit 0
fi

echo "make: setting up $venv (Python $version, torch build: $build); later runs skip this"
created=0
if [ ! -x "$venv/bin/python" ]; then
    created=1
    rm -rf "$venv"
    "$python" -m venv "$venv" || fail "2/4 (create the venv)" "'$python -m venv $venv' failed (Debian/Ubuntu: apt install python3-venv)"
fi
rm -f "$venv/.installed"
if [ "${build%% *}" = cpu ]; then
    # PyTorch's CPU wheels' index beside PyPI: pip prefers `2.13.0+cpu` to PyPI's CUDA build.
    # Probed first: an unreachable index costs pip minutes of retries per package.
    if "$venv/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$cpu_index/" >/dev/null 2>&1; then
        torch_args+=(--extra-index-url "$cpu_index")
    else
        echo "make: $cpu_index does not answer; torch comes from pip's own indexes (TORCH_CPU_INDEX names a mirror)"
    fi
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "${torch_args[@]}" \
    || fail "3/4 (install torch, $build)" "pip could not install $torch_spec (no network, or no wheel for Python $version?); see pip's message above"
"${pip[@]}" -e ".[hf,dev]" \
    || fail "4/4 (install the project)" "pip could not install the project's dependencies (no network?); see pip's message above"
echo "$key" > "$venv/.installed"
echo "make: $venv is ready: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)"
