#!/usr/bin/env bash
# Every GPU check of the project in one command, for a machine with one CUDA GPU (about
# six minutes on an H100): `pytest -m gpu`, `benchmarks/gpu.py`, the Atari example's
# frame rate with central inference on the GPU (when ale-py is installed), where the
# echo's time goes (`benchmarks/gpu_breakdown.py`, `gpu_timeline.py`), the floor of a round
# trip with no framework (`gpu_floor.py`), and the echoes again under NVIDIA's MPS daemon
# (when nvidia-cuda-mps-control is there).
#
# Run from the repository root:  [PYTHON=python] [BUDGET=seconds] bash benchmarks/gpu_all.sh [OUTDIR]
# On a lent machine, which reaches no package index, the packages it lacks travel as wheels:
# `bash tools/gpu_wheels.sh` here puts them in .whl/, the device call carries .whl, and
# this script installs them (into /tmp/site, on PYTHONPATH) before anything runs.
# Every step's output goes to one file, OUTDIR/all.txt (default OUTDIR: $OUT/gpu_all where
# the device tool sets $OUT, whose files alone come back, and only a few of them, else
# runs/gpu_all), and to the terminal, line by line (a call cut at its limit keeps what its
# running step printed so far); a step that fails or runs past its limit is reported and
# the next one still runs.
#
# Why one script: a lent GPU comes for minutes, so every check runs in one call, in the
# order of what matters most, each step under its own time limit, and all of them within
# BUDGET seconds (default 520: one call of the device tool may take 600, and a session
# needs the rest to start the machine): a step is cut to what is left, or skipped.
set -u
out=${1:-${OUT:+$OUT/gpu_all}}
out=${out:-runs/gpu_all}
budget=${BUDGET:-520}
started=$SECONDS
mkdir -p "$out"
log=$out/all.txt
export PYTHONUNBUFFERED=1
# The scripts import machinlike from this checkout (pytest finds it from the root anyway;
# a script run by path does not).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
# TensorPipe's warnings of peers that went away (the churn's SIGKILLs) drown the figures.
quiet() { grep --line-buffered -v "tensorpipe_agent\|socket.cpp\|UserWarning\|^  assert\|^Consider"; }

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - started)))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped (${left} s of the ${budget} s budget left)" | tee -a "$log"
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (at most ${limit} s)" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | quiet | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "== $name: exit status $rc" | tee -a "$log"
}

if ! "$py" -c "import torch" 2>/dev/null; then
  echo "$py cannot import torch: name the interpreter, PYTHON=path/to/python bash $0"
  exit 1
fi
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no GPU: benchmarks/gpu_all.sh has nothing to run here"
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels in .whl/ did not install"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi -L 2>/dev/null | tee -a "$log"
# In the order of what matters most: the tests, the figures the issue names, the
# example's frame rate, then where the time goes and the echoes under MPS.
step pytest_gpu 170 "$py" -m pytest -m gpu -q -p no:benchmark --durations=20 tests/
step gpu 190 "$py" benchmarks/gpu.py
if "$py" -c "import ale_py" 2>/dev/null; then
  step atari 80 "$py" examples/impala_atari.py --algo impala --device cuda --inference central \
    --num-workers 14 --time-budget 50
fi
step breakdown 40 "$py" benchmarks/gpu_breakdown.py --repeats 100
step timeline 30 "$py" benchmarks/gpu_timeline.py --repeats 300
step floor 30 "$py" benchmarks/gpu_floor.py
# Which hand-off costs what here (experiments, see gpu_timeline.py's doc).
for variant in inline-release no-settle; do
  step "timeline_$variant" 25 "$py" benchmarks/gpu_timeline.py --repeats 300 --variant "$variant"
done
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/machinlike-mps}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/machinlike-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    step gpu_mps 40 "$py" benchmarks/gpu.py --only-echo
    step timeline_mps 30 "$py" benchmarks/gpu_timeline.py --repeats 300
    step floor_mps 30 "$py" benchmarks/gpu_floor.py
    echo quit | nvidia-cuda-mps-control
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
echo "== done in $((SECONDS - started)) s: $log" | tee -a "$log"
