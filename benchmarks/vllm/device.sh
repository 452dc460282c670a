#!/usr/bin/env bash
# offload-core inside vLLM 0.33.0 on a GPU machine without network (the lent one), from the root of
# this repository. vLLM comes as the two parts ../shared/tools/vllm-gpu-bundle.sh builds, carried
# in two calls (the machine stays warm for 30 s between them); vLLM's test files as a folder.
#
#   bash benchmarks/vllm/device.sh wheels                    # here, with registry access: what the bundle lacks
#                                                            # to serve a model, as wheels in .whl/ (carry it in call 2)
#   bash benchmarks/vllm/device.sh stage PART00              # call 1: keep the first part in /tmp/vb
#   bash benchmarks/vllm/device.sh install PART01            # call 2: unpack vLLM into /tmp/site, install offload-core
#                                                            # (and the wheels in .whl/: what the bundle lacks to serve)
#   bash benchmarks/vllm/device.sh tests VLLM_TESTS OUT      # vLLM's GPU worker tests against offload-core's worker,
#                                                            # and tests/test_vllm.py on cuda
#   bash benchmarks/vllm/device.sh serve OUT [serve.py's options]
#
# On a machine with vLLM installed, only the last two are needed (VLLM_TESTS: the tests/ folder of
# vLLM 0.33.0's sdist, or a copy of its __init__.py files and tests/v1/kv_offload).
set -u
cmd=$1; shift
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
case $cmd in
wheels)
  # vLLM 0.33.0's requirements/common.txt pins, for what loading and serving a dense model imports
  mkdir -p .whl && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    compressed-tensors==0.17.0 loguru blake3 setproctitle depyf==0.20.0 astor dill ijson jsonschema \
    jsonschema-specifications referencing rpds-py lark==1.2.2 python-json-logger interegular \
    outlines_core==0.2.14 lm-format-enforcer==0.11.3 ;;
stage)
  mkdir -p /tmp/vb && cp "$1" /tmp/vb/part00
  nvidia-smi -L; df -h /dev/shm /tmp | tail -2; free -g | head -2 ;;
install)
  cat /tmp/vb/part00 "$1" | tar xf - -C /tmp/vb && mkdir -p /tmp/site && tar xJf /tmp/vb/vllm.tar.xz -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vb/deps/*.whl $(ls .whl/*.whl 2>/dev/null) || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v WARNING | tail -2
  python3 -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" ;;
tests)
  src=$(cd "$1" && pwd); out=$2; mkdir -p "$out"; here=$(pwd)
  # vLLM's data-path tests; the ones that mock vLLM's own worker internals are left out (they test its code)
  (cd "$src/.." && PYTHONPATH="$here/benchmarks/vllm:$PYTHONPATH" timeout 240 python3 -m pytest -q -p no:cacheprovider -p vllm_tests --rootdir=. -o addopts= \
    --confcutdir=tests/v1/kv_offload tests/v1/kv_offload/cpu/test_gpu_worker.py \
    -k "test_transfer or pending_compute_stream" -rA) > "$out/vllm-gpu-worker.log" 2>&1
  echo "vLLM test_gpu_worker (offload-core's worker): rc=$?"; grep -E "passed|failed" "$out/vllm-gpu-worker.log" | tail -1
  OFFLOAD_CORE_REQUIRE_VLLM=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_vllm.py > "$out/test_vllm.log" 2>&1
  echo "tests/test_vllm.py on cpu and cuda: rc=$?"; tail -1 "$out/test_vllm.log" ;;
serve)
  out=$1; shift
  python3 benchmarks/vllm/serve.py --out "$out" "$@" ;;
*)
  echo "usage: device.sh stage|install|tests|serve ..." >&2; exit 2 ;;
esac
