#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, no package registry there): what the
# tuner needs beyond that machine's image (Ray, Optuna, pydantic, joblib and their own needs),
# into .whl/ (ignored by git; carried with the device tool's `carry: [".whl"]`).
set -eu
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
mkdir -p .whl /tmp/gpu-wheels
python3 -m pip download -q --no-deps "${plat[@]}" -d /tmp/gpu-wheels ray==2.60.0 optuna==5.0.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions alembic sqlalchemy mako colorlog \
  jsonschema jsonschema-specifications referencing rpds-py tensorboardx joblib
for w in /tmp/gpu-wheels/*.whl; do
  case $w in */ray-*) ;; *) cp "$w" .whl/ ;; esac
done
rm -rf /tmp/gpu-wheels/ray && mkdir /tmp/gpu-wheels/ray && (cd /tmp/gpu-wheels/ray && unzip -q ../ray-*.whl \
  && rm -rf ray/jars ray/rllib ray/llm ray/serve ray/dashboard/client/build && tar cJf - ray ray-*.dist-info) > .whl/ray.tar.xz
du -sh .whl
