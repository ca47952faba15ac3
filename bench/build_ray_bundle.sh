#!/usr/bin/env bash
# Packs ray 2.60.0 (Ray Data included) for the GPU machine, which has Python 3.12 and no network:
# an installed site tree, trimmed and xz-compressed to about 19 MiB, under .raybundle/ (git-ignored),
# to carry with the repository. The GPU image already has ray's other dependencies (click, filelock,
# msgpack, packaging, protobuf, pyyaml, requests, numpy, pandas, pyarrow, fsspec, attrs); jsonschema
# and its three helpers are not there, so they are packed too.
# Removed: the dashboard's web client, the Java jars, and the libraries tokenmill does not use
# (rllib, tune, train, serve, llm, workflow); the three native binaries lose their symbol tables.
# On the GPU machine (bench/gpu_suite.sh ray does this):
#   mkdir -p /tmp/ray-site && tar -C /tmp/ray-site -xJf .raybundle/ray260-py312-slim.tar.xz
#   PYTHONPATH=/tmp/ray-site python3 bench/ray_bench.py ...
# Checked on this machine with Python 3.12.1 and only the packages named above: ray.init() and a
# Ray Data map_batches over an actor pool run from the extracted tree.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WHEELS:-/tmp/ray-wheels}; S=/tmp/ray-bundle-site; mkdir -p "$W" .raybundle
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$W" \
  ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
rm -rf "$S"; mkdir -p "$S"
for w in "$W"/*.whl; do python3 -c "import sys,zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$S"; done
rm -rf "$S"/ray/{rllib,tune,train,serve,llm,workflow,jars,setup-dev.py} "$S"/ray/dashboard/client
find "$S" -name "__pycache__" -type d -prune -exec rm -rf {} + ; find "$S" -name "*.pyi" -delete
bins="$S/ray/_raylet.so $S/ray/core/src/ray/raylet/raylet $S/ray/core/src/ray/gcs/gcs_server"
strip --strip-unneeded $bins
# zipfile drops the executable bits the wheel records; the raylet and the GCS server are started as programs.
python3 - "$S" "$W" <<'PY'
import os, sys, zipfile, glob
site, wheels = sys.argv[1:]
for wheel in glob.glob(os.path.join(wheels, "*.whl")):
    for info in zipfile.ZipFile(wheel).infolist():
        path = os.path.join(site, info.filename)
        if (info.external_attr >> 16) & 0o111 and os.path.exists(path):
            os.chmod(path, 0o755)
PY
tar -C "$S" -cf - . | xz -9e -T2 > .raybundle/ray260-py312-slim.tar.xz
ls -la .raybundle
