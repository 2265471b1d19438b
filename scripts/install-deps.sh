#!/usr/bin/env bash
# Installs what lmoe needs to build and test (Debian/Ubuntu packages and numpy for the CLI tests).
# Options add what only some scripts need:
#   --tests     a python3 with torch and safetensors for the PyTorch baseline's test
#               (tests/cli/test_torch_baseline.py; Debian's CPU build of torch)
#   --fuzz      clang 19 and its libFuzzer runtime (scripts/fuzz.sh; clang 14 lacks the builtin that
#               libstdc++'s std::source_location needs, and Debian 12 and Ubuntu 24.04 package 19)
#   --coverage  gcovr (scripts/coverage.sh)
#   --cutlass   CUTLASS's headers for the CUDA build, from the pinned nvidia-cutlass wheel (PyPI; only
#               its headers are used, so none of its Python dependencies), found by cmake/cutlass.cmake
#   --format    clang-format 14, the version whose output the tree is checked against
#               (scripts/check-format.sh)
#   --python    a virtual environment build/python-venv (from the python3 on PATH) with the pinned
#               torch from PyPI, scikit-build-core, pytest and numpy, for the Python package and its
#               tests (docs/python.md says why this torch and what it costs); reused when present
# Idempotent: does nothing when everything is already there.
set -euo pipefail

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
wants() { [[ " $options " == *" $1 "* ]]; }
options="$*"

# Debian packages not installed yet, in one apt-get run.
apt_install() {
  local missing=() package
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
  done
  ((${#missing[@]})) || return 0
  echo "install-deps: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# A PyPI package for a python3, unless that python3 can import its module; where pip refuses to touch
# a system python (PEP 668), installed beside the system's packages anyway.
pip_install() {  # python, module, package
  "$1" -c "import $2" 2>/dev/null && return 0
  echo "install-deps: installing $3 for $1 (pip)" >&2
  "$1" -m pip install -q "$3" 2>/dev/null || "$1" -m pip install -q --break-system-packages "$3"
}

apt_install cmake ninja-build g++ libopenblas-dev libopenmpi-dev openmpi-bin libcli11-dev \
  nlohmann-json3-dev libgtest-dev libgmock-dev python3 python3-pip
pip_install python3 numpy numpy

# The PyTorch baseline's test runs with whichever python3 has torch (gloo) and safetensors; where none
# has, Debian's CPU build of torch goes to the system python3 and safetensors from PyPI beside it.
if wants --tests; then
  has_torch() {
    "$1" -c 'import torch, torch.distributed as d, safetensors.torch; assert d.is_gloo_available()' 2>/dev/null
  }
  if ! has_torch python3 && ! has_torch /usr/bin/python3; then
    /usr/bin/python3 -c 'import torch' 2>/dev/null || apt_install python3-torch
    pip_install /usr/bin/python3 safetensors safetensors
  fi
fi
if wants --fuzz; then apt_install clang-19 libclang-rt-19-dev; fi
if wants --coverage; then pip_install python3 gcovr gcovr; fi
if wants --format; then apt_install clang-format-14; fi
# Keep in step with LMOE_CUTLASS_VERSION in cmake/cutlass.cmake.
LMOE_CUTLASS_WHEEL="nvidia-cutlass==4.2.0.0"
if wants --cutlass && ! python3 -c "import cutlass_library, os, sys
h = os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include', 'cutlass', 'version.h')
sys.exit('CUTLASS_MINOR 2' not in open(h).read() or 'CUTLASS_MAJOR 4' not in open(h).read())" 2>/dev/null; then
  echo "install-deps: installing $LMOE_CUTLASS_WHEEL (headers) for python3 (pip --no-deps)" >&2
  python3 -m pip install -q --no-deps "$LMOE_CUTLASS_WHEEL" 2>/dev/null ||
    python3 -m pip install -q --no-deps --break-system-packages "$LMOE_CUTLASS_WHEEL"
fi

# The torch the Python package is built and tested against. PyPI's Linux wheel is the CUDA build
# and brings NVIDIA's libraries (about 2.9 GB); the ops run on its CPU side here.
LMOE_PYTHON_TORCH="${LMOE_PYTHON_TORCH:-torch==2.5.1}"
if wants --python; then
  apt_install python3-venv
  venv="$(cd "$(dirname "$0")/.." && pwd)/build/python-venv"
  want_torch="${LMOE_PYTHON_TORCH#torch==}"
  if ! "$venv/bin/python" -c "import torch, pytest, numpy, scikit_build_core, sys
sys.exit(torch.__version__.split('+')[0] != '$want_torch')" 2>/dev/null; then
    echo "install-deps: installing $LMOE_PYTHON_TORCH, scikit-build-core, pytest, numpy in $venv" >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "$LMOE_PYTHON_TORCH" "scikit-build-core>=0.10" pytest numpy
  fi
fi
