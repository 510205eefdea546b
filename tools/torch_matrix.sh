#!/usr/bin/env bash
# Run machinlike's tests against each torch it claims, each in a fresh virtual
# environment, and print one table row per torch (the README's "Tested versions" table
# is this output).
#
# Usage: tools/torch_matrix.sh [--full | --ci | --install-only] [--python PY] [VERSION ...]
#   VERSION         torch releases to test (default: the claimed ones, $CLAIMED below)
#   --full          the whole suite instead of the smoke subset ($SMOKE below); the
#                   environment gets the test, examples and machin extras too
#   --ci            CI's smaller subset ($CI_SMOKE below, a minute or two per torch);
#                   exits 3, not 1, when a release cannot be downloaded here, so that
#                   CI can tell "not testable on this machine" from "tests failed"
#   --install-only  make the environments, test nothing (several such runs can go in
#                   parallel, downloads overlapping; a later run tests)
#   --python        the interpreter the environments are made from (default: python3)
#
# Environment:
#   MATRIX_DIR  where the environments live (default /tmp/machinlike-torch-matrix); one
#               that exists already is reused, so a second run only tests
#   FRESH=1     remake the environments
#
# Why a fresh environment per torch: pip cannot hold two torch releases side by side, and
# the project's shared environment must keep the pinned one (constraints.txt). Tests run
# from this checkout through PYTHONPATH (spawned ranks inherit it), so nothing of
# machinlike is installed. The runs are niced: this is background work on shared machines.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# The claimed range: the oldest release setup.cfg allows (2.8), the lent GPU machines'
# torch (2.11), the pinned one, the newest that lies on this machine's disk (a CUDA build:
# pulls its nvidia packages) and the newest release. Keep it in step with setup.cfg's torch
# bound and the README's table. (2.7 and 2.6 pass the smoke subset, but the older store
# server they need for a listening socket holds every reply of an empty value 208 ms, so a
# race test of destroy() outlasts its barrier in some runs; 2.2.2, the first bound, has no
# TCPStore.check.)
CLAIMED=(2.8.0 2.11.0 2.13.0 2.14.1 2.15.0)
# The smoke subset: the modules where torch's API is used most directly (pickling and
# sharing, collectives, RPC groups, servers, pools); a few minutes per torch.
SMOKE=(tests/test_exports.py tests/test_pickle.py tests/test_collective.py tests/test_rpc_group.py
       tests/test_server_grad_machin.py tests/test_pool_tensors.py)
# CI's subset (--ci): the public names, the pickler (torch's reducers), the collectives
# (the gloo ops that moved between releases) and the type check (torch's stubs change: 2.14's
# typed a collective's Work as Optional), within CI's few minutes.
CI_SMOKE=(tests/test_exports.py tests/test_pickle.py tests/test_collective.py tests/test_types.py)

full=0
ci=0
install_only=0
python=python3
versions=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full) full=1 ;;
    --ci) ci=1 ;;
    --install-only) install_only=1 ;;
    --python) shift; python=$1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) echo "torch_matrix.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) versions+=("$1") ;;
  esac
  shift
done
[ ${#versions[@]} -gt 0 ] || versions=("${CLAIMED[@]}")
matrix_dir=${MATRIX_DIR:-/tmp/machinlike-torch-matrix}
mkdir -p "$matrix_dir"
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || {
  echo "torch_matrix.sh: cannot run $python" >&2; exit 2; }
if [ $full = 1 ]; then tests=(tests); scope=full
elif [ $ci = 1 ]; then tests=("${CI_SMOKE[@]}"); scope=ci-smoke
else tests=("${SMOKE[@]}"); scope=smoke; fi

# An empty constraints file: the machine-wide pip constraint may cap torch below the
# release asked for; the requirement below names the release exactly instead.
no_cap="$matrix_dir/no-constraints.txt"
: > "$no_cap"

rows=()
unavailable=0
for v in "${versions[@]}"; do
  env_dir="$matrix_dir/py$pyver-torch-$v"
  log="$matrix_dir/py$pyver-torch-$v.log"
  [ "${FRESH:-0}" = 1 ] && rm -rf "$env_dir"
  status=ok
  # Reused only when its install finished (a run killed mid-install leaves a half one).
  [ -e "$env_dir/.installed-mypy" ] || rm -rf "$env_dir"  # (-mypy: envs made before mypy was in them are remade)
  if [ ! -x "$env_dir/bin/python" ]; then
    echo "== torch $v: making $env_dir (log: $log)"
    # NumPy 2 breaks torch releases built before it (2.2 and older).
    numpy=numpy
    if "$python" -c "import sys; v = tuple(map(int, '$v'.split('.')[:2])); sys.exit(v >= (2, 3))"; then
      numpy="numpy<2"
    fi
    if ! { "$python" -m venv "$env_dir" &&
           PIP_CONSTRAINT="$no_cap" nice -n 10 "$env_dir/bin/pip" install -q --no-compile "torch==$v" "$numpy" \
             "dill>=0.3.6" "pytest>=7.4" "pytest-timeout>=2.2" "mypy>=1.8" &&
           touch "$env_dir/.installed-mypy"; } > "$log" 2>&1; then
      # (--no-compile: byte-compiling torch's thousands of modules up front costs a
      # minute; the tests compile what they import.)
      status="install failed"
      # Nothing to download from (no index has the release, or no network): not a
      # failure of machinlike's; --ci reports it apart.
      if grep -qiE "no matching distribution|could not find a version|failed to establish a new connection|name or service not known|temporary failure in name resolution|network is unreachable|connection broken|read timed out" "$log"; then
        status="cannot be downloaded here"
        unavailable=1
      fi
      rm -rf "$env_dir"
    fi
  fi
  if [ "$status" = ok ] && [ $full = 1 ] && [ ! -e "$env_dir/.installed-extras" ]; then
    # The whole suite imports what the README's test command installs (gymnasium, Ray,
    # Sphinx, machin's own imports...): the test, examples and machin extras of setup.cfg,
    # torch held at this release, then machin itself without its declared requirements.
    echo "== torch $v: adding the test, examples and machin extras (log: $log)"
    mapfile -t extras < <("$python" -c '
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
for name in ("test", "examples", "machin"):
    for line in cfg["options.extras_require"][name].splitlines():
        line = line.split("#")[0].strip()
        if line:
            print(line)
' "$root/setup.cfg")
    if { PIP_CONSTRAINT="$no_cap" nice -n 10 "$env_dir/bin/pip" install -q "torch==$v" "${extras[@]}" &&
         PIP_CONSTRAINT="$no_cap" nice -n 10 "$env_dir/bin/pip" install -q --no-deps machin==0.4.2 &&
         touch "$env_dir/.installed-extras"; } >> "$log" 2>&1; then :; else
      status="installing the extras failed"
    fi
  fi
  if [ "$status" = ok ] && [ $install_only = 1 ]; then
    rows+=("| $v | $("$env_dir/bin/python" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1) | $pyver | - | installed | - |")
  elif [ "$status" = ok ]; then
    got=$("$env_dir/bin/python" -c 'import torch; print(torch.__version__)' 2>>"$log") || got="import failed"
    echo "== torch $got ($scope): ${tests[*]}"
    start=$(date +%s)
    before=$(wc -l < "$log")  # the log is appended to: read this run's lines only
    PYTHONPATH="$root" nice -n 10 "$env_dir/bin/python" -m pytest "${tests[@]}" -q -p no:cacheprovider \
      >> "$log" 2>&1
    code=$?
    secs=$(( $(date +%s) - start ))
    summary=$(tail -n +$((before + 1)) "$log" | grep -E '^(=+ )?[0-9]+ (passed|failed|error)' | tail -1 |
              sed -E 's/=+//g; s/^ +| +$//g')
    [ $code = 0 ] && status="ok" || status="FAILED"
    rows+=("| $v | $got | $pyver | $scope | $status: ${summary:-no summary, see $log} | $secs s |")
  else
    rows+=("| $v | - | $pyver | $scope | $status (see $log) | - |")
  fi
done

echo
echo "| torch asked | torch run | Python | tests | result | time |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
failed=0
for row in "${rows[@]}"; do
  case "$row" in
    *"| ok:"*|*"| installed |"*) ;;
    *"cannot be downloaded here"*) ;;
    *) failed=1 ;;
  esac
done
[ $failed = 1 ] && exit 1
if [ $unavailable = 1 ]; then
  # Without --ci a release that cannot be had is a failure of the matrix as before.
  [ $ci = 1 ] && exit 3 || exit 1
fi
exit 0
