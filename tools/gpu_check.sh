#!/usr/bin/env bash
# A GPU machine's whole check, in one go (a lent GPU's minutes are few): the Triton kernels and
# the cuda backend compiled on the GPU against their torch references (the test files that run
# in Triton's interpreter everywhere else: on a GPU they run compiled), then their timings and
# the engine end to end. Each step's output lands in OUT_DIR (default ./gpu-check).
#
#     tools/gpu_check.sh [OUT_DIR]
#
# Needs python3 with torch (a CUDA build), triton, transformers, pytest (pytest-xdist if there)
# and the project's dependencies; the default model's package for SmolLM2's tokenizer.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$out/machine.txt"
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider $workers --durations=10 --junitxml="$out/junit.xml" \
    tests/test_attention_kernel.py tests/test_norm_kernels.py tests/test_sampling_kernels.py \
    tests/test_exact_math.py tests/test_quant_gemm_triton.py tests/test_delta_net_triton.py \
    tests/test_compiled_kernels.py tests/test_cuda_backend.py tests/test_quantized_model.py tests/test_dense_gemm_triton.py \
    2>&1 | tee "$out/tests.log" | tail -60
timeout -k 5 90 python3 tools/bench_kernels.py 2>&1 | tee "$out/bench_kernels.md"
timeout -k 5 200 python3 tools/bench_cuda.py --streams 1,8,32 --repeats 2 2>&1 | tee "$out/bench_cuda.md"
