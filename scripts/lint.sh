#!/usr/bin/env bash
# Lint and format checks (CI runs this; pre-commit runs the same tools on staged files):
#   ruff check + ruff format --check   for Python (pyproject.toml [tool.ruff])
#   clang-format --dry-run -Werror     for C++ (.clang-format)
#   scripts/lint.sh --fix              applies the fixes and the formatting instead
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
mapfile -t cxx < <(git ls-files 'cpp/*.cpp' 'cpp/*.h' 'bindings/*.cpp' 'bindings/*.h' 'fuzz/*.cpp' 'fuzz/*.h')
if [[ "${1:-}" == "--fix" ]]; then
    "$BIN/ruff" check --fix .
    "$BIN/ruff" format .
    "$BIN/clang-format" -i "${cxx[@]}"
else
    "$BIN/ruff" check .
    "$BIN/ruff" format --check .
    "$BIN/clang-format" --dry-run -Werror "${cxx[@]}"
fi
echo "lint: ok"
