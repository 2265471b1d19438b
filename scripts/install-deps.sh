#!/usr/bin/env bash
# Installs what lmoe needs to build and test (Debian/Ubuntu packages and numpy for the CLI tests).
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
