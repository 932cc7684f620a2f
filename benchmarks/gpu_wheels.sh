#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels of the training stack that the GPU image
# lacks: grain (and its array_record and portpicker), ml_collections, tensorboardX and
# qwix (model/quant.py: every stage that imports model/), for
# that machine's Python 3.12 on x86_64, at the versions CI tests here. The GPU machine has
# no network; run this here, then name .whl in the device call's carry, and
# benchmarks/gpu_session.sh installs them into /tmp/site before its first stage.
# The planner, planner_64k and train_* stages import them; the kernel stages and serve
# do not. About 5 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 ml-collections==1.1.0 \
  tensorboardX==2.6.5 qwix==0.1.8
# --tokamax: tokamax (benchmarks.attention's second anchor) and what it imports that the
# image lacks. Not its xprof (32 MB, with cloud-storage clients): tokamax imports it only
# for its own profiling helper, which gpu_session.sh stubs out.
if [[ ${1:-} == --tokamax ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl tokamax==0.0.17 einshape==1.0 immutabledict==4.3.1 \
    pydantic==2.11.9 pydantic-core==2.33.2 annotated-types==0.8.0 typing-inspection==0.4.5
fi
ls -l .whl
