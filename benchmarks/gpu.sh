#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (under 9 minutes on an H100 or H200, each stage under its own time limit):
#
#   bash benchmarks/gpu.sh [OUT]
#
# 1. the CUDA tests: tests/torch/test_torch_cuda.py, test_torch_triton.py and
#    the CUDA cases of test_torch_fused.py (every option of the fused kernels);
# 2. the recorded benchmarks, each naming the device in its header
#    (docs/benchmarks/record.py): torch_step --device cuda (ResNet-18 shapes and
#    500 x 1k, the capturable rows included) and --scale (one tensor of 1e6, 1e7
#    and 1e8 values, with the bandwidth each step reaches);
# 3. where a fused step's time goes (benchmarks/cuda_anatomy.py: host, launch and
#    kernel time against torch's fused SGD and Adam), into OUT only.
#
# It needs python3 with torch (a CUDA build, which brings Triton), pytest,
# hypothesis and scipy, and nothing from the network. The test log and the
# recorded files are copied to OUT (default artifacts/gpu); copy the .txt files
# into docs/benchmarks/ to publish them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-artifacts/gpu}}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/device.txt"

# Workers where pytest-xdist is installed: most of the tests' time is Triton
# compiling each kernel's variants, one core each. Each stage has a time limit,
# so that one stuck stage leaves the others their time.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
python3 -c "import pytest_timeout" 2>/dev/null && workers+=(--timeout 120)
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W error "${workers[@]}" \
    tests/torch/test_torch_cuda.py tests/torch/test_torch_triton.py \
    "tests/torch/test_torch_fused.py" tests/torch/test_torch_qhmuon.py -k "cuda or triton" \
    2>&1 | tee "$OUT/cuda-tests.txt" || status=1

record() {
    timeout "${limit:-100}" python3 docs/benchmarks/record.py "$@" || status=1
}
timeout 70 python3 -m benchmarks.cuda_anatomy 2>&1 | tee "$OUT/cuda-anatomy.txt" || status=1
record torch_step_cuda -- python3 -m benchmarks.torch_step --device cuda --steps 20
limit=80 record torch_step_cuda_scale -- python3 -m benchmarks.torch_step --device cuda --scale --steps 20
limit=50 record muon_step_torch_cuda -- python3 -m benchmarks.muon_step --framework torch --device cuda
cp docs/benchmarks/torch_step_cuda.txt docs/benchmarks/torch_step_cuda_scale.txt \
    docs/benchmarks/muon_step_torch_cuda.txt "$OUT/" || status=1
exit $status
