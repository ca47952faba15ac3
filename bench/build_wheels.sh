#!/usr/bin/env bash
# The wheels the GPU tests need that the GPU machine's image lacks (gguf for GGUF loading,
# compressed-tensors and its own needs for the quantized-checkpoint tests, peft and accelerate for the
# LoRA tests' references, xgrammar and its apache-tvm-ffi for structured outputs), into .whl/ (git-ignored),
# at the versions installed here, so the device runs what CI runs (a compressed-tensors 0.17.0 there
# once failed the checkpoint tests: pyproject asks for >= 0.20). On the device, each call that needs
# them carries .whl and starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=$PWD:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
pins=""
for name in gguf compressed-tensors peft accelerate loguru pydantic pydantic-core annotated-types typing-inspection typing-extensions \
    xgrammar apache-tvm-ffi; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "$name is not installed here: pip install -e '.[test]' first" >&2; exit 1; }
  pins="$pins $name==$version"
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
