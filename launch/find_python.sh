#!/bin/sh
# Prints the path of the Python that `make` builds .venv with: $PYTHON if given, else the first of
# python3.13, python3.12, python3 that is 3.12 or newer and runs, else the oldest 3.12+ installed under
# pyenv (its shims refuse a version that is not selected, but the interpreter runs from its own folder;
# the oldest: 3.12 is what the stack's peers run, MaxText and the GPU images).
# Otherwise prints one `error:` line saying how to get one, and exits 1.
usable() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
found() {
  # A Debian or Ubuntu Python without its venv package cannot make .venv: say which package it is.
  if ! "$1" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    v=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    echo "error: $1 (Python $v) cannot make a venv: install its venv module (Debian, Ubuntu: apt install python$v-venv)" >&2
    exit 1
  fi
  command -v "$1"
  exit 0
}

if [ -n "${PYTHON:-}" ]; then
  usable "$PYTHON" && found "$PYTHON"
  echo "error: PYTHON=$PYTHON is not a Python 3.12 or newer that runs" >&2
  exit 1
fi
for name in python3.13 python3.12 python3; do
  command -v "$name" >/dev/null 2>&1 && usable "$name" && found "$name"
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.[0-9]+\.[0-9]+$' | sort -t. -k1,1n -k2,2n -k3,3n); do
    usable "$root/versions/$version/bin/python3" && found "$root/versions/$version/bin/python3"
  done
fi
have=$( (python3 --version 2>&1 || echo "no python3 that runs") | head -n 1)  # A refusing shim says more.
echo "error: the template needs Python 3.12 or newer ($have here): install one (Ubuntu, Debian: apt install python3.12-venv; macOS: brew install python@3.12; any: uv python install 3.12), then make again, or PYTHON=/path/to/python3.12 make" >&2
exit 1
