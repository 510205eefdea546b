#!/usr/bin/env bash
# The Python packages a lent GPU machine lacks, as wheels in .whl/ (git ignores it), for
# benchmarks/gpu_all.sh to install there: dill (a dependency of machinlike), and
# gymnasium, farama-notifications and ale-py for the Atari step. The machine has torch,
# numpy, cloudpickle, typing-extensions and pytest with its plugins already
# (.library/device/KINDS.md); it reaches no package index, so the wheels travel with the
# call (name .whl in the device tool's carry).
#
# Run here, from the repository root:  bash tools/gpu_wheels.sh
# Then on the device:                  bash benchmarks/gpu_all.sh   (it installs .whl/*.whl first)
set -eu
py=${PYTHON:-python3}
rm -rf .whl
mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# Versions from this machine's virtual environment where it has them: the ones the suite ran.
want() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true; }
for name in dill gymnasium farama-notifications ale-py; do
  version=$(want "$name")
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$name${version:+==$version}"
done
ls -l .whl
du -sh .whl
