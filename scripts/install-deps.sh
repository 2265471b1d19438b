#!/usr/bin/env bash
# Installs what lmoe needs to build and test (Debian/Ubuntu packages and numpy for the CLI tests);
# with --tests also what only the test suite needs: a python3 with torch and safetensors for the
# PyTorch baseline's test (tests/cli/test_torch_baseline.py; Debian's CPU build of torch).
# Idempotent: does nothing when everything is already there.
set -euo pipefail

packages=(cmake ninja-build g++ libopenblas-dev libopenmpi-dev openmpi-bin libcli11-dev
          nlohmann-json3-dev libgtest-dev libgmock-dev python3 python3-pip)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! python3 -c 'import numpy' 2>/dev/null; then
  echo "install-deps: installing numpy (pip)" >&2
  python3 -m pip install -q numpy 2>/dev/null || python3 -m pip install -q --break-system-packages numpy
fi

# The PyTorch baseline's test runs with whichever python3 has torch (gloo) and safetensors; where none
# has, Debian's CPU build of torch goes to the system python3 and safetensors from PyPI beside it.
if [[ " $* " == *" --tests "* ]]; then
  has_torch() {
    "$1" -c 'import torch, torch.distributed as d, safetensors.torch; assert d.is_gloo_available()' 2>/dev/null
  }
  if ! has_torch python3 && ! has_torch /usr/bin/python3; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
      echo "install-deps: installing python3-torch (the PyTorch baseline's test)" >&2
      $sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-torch >/dev/null
    fi
    if ! /usr/bin/python3 -c 'import safetensors' 2>/dev/null; then
      echo "install-deps: installing safetensors for /usr/bin/python3 (pip)" >&2
      $sudo /usr/bin/python3 -m pip install -q safetensors 2>/dev/null ||
        $sudo /usr/bin/python3 -m pip install -q --break-system-packages safetensors
    fi
  fi
fi
