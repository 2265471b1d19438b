#!/usr/bin/env bash
# Checks that every tracked C++ and CUDA source is formatted as .clang-format says, with clang-format
# 14 (CI's; other versions place some tokens differently). --fix rewrites the files instead.
# Usage: bash scripts/check-format.sh [--fix]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --format
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.h')
if [ "${1:-}" = "--fix" ]; then
  clang-format-14 -i "${files[@]}"
  exit 0
fi
if ! clang-format-14 --dry-run --Werror "${files[@]}"; then
  echo "check-format: the files above differ from .clang-format; bash scripts/check-format.sh --fix" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted as .clang-format says"
