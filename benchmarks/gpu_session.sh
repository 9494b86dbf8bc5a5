#!/usr/bin/env bash
# Every GPU check and benchmark in one go, for a short lease on a bare CUDA machine that has torch,
# triton and transformers but not gptforge's other dependencies (pydantic must be importable;
# Prefect, MLflow, DVC and lm-eval are not needed):
#
#   PYTHONPATH=src:. bash benchmarks/gpu_session.sh RESULTS_DIR [PRETRAIN_DATA_DIR] [ARCHIVE.tgz]
#
# 1. the suite's device-dependent tests on CUDA (the Triton kernels compiled for the GPU rather
#    than interpreted, the model, KV-cached decoding, checkpoints' CUDA RNG, the loader to CUDA);
# 2. benchmarks/gpu_report.py: CUDA paths against their references, the 124M step, decoding;
# 3. the benchmark stage (grid, attention and cross-entropy kernels) and 4. the pretrain stage's
#    loop, both on configs/gpt2-124m-fineweb.yaml (benchmarks/gpu_stages.py).
# Each part has its own time limit and the results are archived after each, so a part that
# fails or runs out of time costs only itself.
set -u
R=${1:?results folder}
DATA=${2:-data/pretrain}
ARCHIVE=${3:-}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
pack() { [ -n "$ARCHIVE" ] && tar czf "$ARCHIVE" --exclude=traces --exclude=ckpt -C "$(dirname "$R")" "$(basename "$R")"; true; }
part() {  # part NAME SECONDS CMD...: run CMD with a time limit, log to R/NAME.log, archive
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$R/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$R/parts.txt"
  pack
}
nvidia-smi >"$R/nvidia-smi.txt" 2>&1
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" >"$R/versions.txt" 2>&1
part pytest 120 python -m pytest --noconftest -p no:cacheprovider -q -rs tests/test_kernels.py tests/test_model.py \
  tests/test_generate.py tests/test_checkpoint.py tests/test_loader.py tests/test_flops.py
part gpu_report 120 python benchmarks/gpu_report.py --steps 10 --warmup 3 --out "$R"
part benchmark 180 python benchmarks/gpu_stages.py benchmark --out "$R/bench"
part pretrain 100 python benchmarks/gpu_stages.py pretrain --data "$DATA" --out "$R/pretrain" --steps 30
