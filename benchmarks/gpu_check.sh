#!/usr/bin/env bash
# The first checks on a machine with one NVIDIA GPU or TPU, in one table (benchmarks/gpu_check.py says what each
# row checks and the bound it is held to); exits 1 when a check failed. On a machine without a GPU it
# says so in one line and exits 0.
#
#   benchmarks/gpu_check.sh            run the checks, on the JAX this machine has (.venv's, else python3's);
#                                      --only=lm_125m,recompute runs those rows alone
#   benchmarks/gpu_check.sh --wheels   on a machine with PyPI: download into build/gpu_wheels the packages
#                                      a GPU image with only jax, flax, optax and orbax lacks (a few MB)
#
# A GPU image without grain, ml_collections or array_record (and no package registry) gets them from
# build/gpu_wheels, carried beside the tree: the checks run on the JAX and CUDA the machine was built with.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu_wheels
# What the trainer imports beyond the image's jax/flax/optax/orbax, with what they pull in.
NEEDED=(grain array_record ml_collections tensorboardX cloudpickle portpicker)

if [ "${1:-}" = --wheels ]; then
  py=.venv/bin/python
  [ -x "$py" ] || py=python3
  mkdir -p "$WHEELS"
  for arch in x86_64 aarch64; do
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform "manylinux2014_$arch" \
      --platform "manylinux_2_17_$arch" --platform "manylinux_2_28_$arch" \
      -c constraints.txt -d "$WHEELS" "${NEEDED[@]}" || exit 1
  done
  echo "gpu_check: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), in $WHEELS"
  exit 0
fi

# A TPU VM shows its chips as /dev/accel* (v4, v5e, v5p) or /dev/vfio/* (v6e).
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } \
  && ! ls /dev/accel* >/dev/null 2>&1 && ! ls /dev/vfio/[0-9]* >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi finds none) and no TPU: nothing to check"
  exit 0
fi
py=.venv/bin/python
[ -x "$py" ] || py=$(command -v python3)
missing=()
for module in "${NEEDED[@]}"; do
  "$py" -c "import $module" >/dev/null 2>&1 || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "error: $py lacks ${missing[*]} and there is no $WHEELS: run benchmarks/gpu_check.sh --wheels where PyPI is reachable, and bring $WHEELS along" >&2
    exit 2
  fi
  # Into a folder of their own on PYTHONPATH, without their dependencies (absl, etils, protobuf, PyYAML:
  # flax and orbax need them too): the image's packages stay as they are, whatever made its python3.
  site=${TMPDIR:-/tmp}/gpu_check_site
  rm -rf "$site"
  "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --find-links "$WHEELS" \
    --target "$site" "${missing[@]}" || { echo "error: the wheels in $WHEELS do not install on $("$py" --version)" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# 8 minutes at most: a check that hangs must not eat the machine's time.
timeout 480 "$py" benchmarks/gpu_check.py "$@"
rc=$?
[ $rc -eq 124 ] && echo "error: gpu_check ran past 8 minutes" >&2
exit $rc
