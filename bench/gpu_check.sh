#!/usr/bin/env bash
# Check the GPU path on a machine with a CUDA GPU, from the repository root:
#
#     bash bench/gpu_check.sh [REPORT]            # default report: gpu_check_report.txt
#     GPU_CHECK_WHEELS=/path/to/wheels bash bench/gpu_check.sh   # a machine without a package registry
#
# 1. installs what is missing: the project's requirements (torch only if the installed one lacks CUDA), from the
#    registry or, with GPU_CHECK_WHEELS, from that folder of wheels only;
# 2. describes the machine (nvidia-smi, torch, CUDA);
# 3. runs the CUDA tests (tests/test_cuda.py: parity in fp32 with TF32 off and under bf16/fp16 autocast, decoding,
#    AdamW on CUDA tensors, every training CLI on cuda, GPU <-> CPU checkpoints, a single-process nccl group),
#    then the whole CPU suite;
# 4. runs the side-by-side benchmark on the GPU: bench/compare_hf.py --device cuda (training step, forward,
#    greedy generation at batch 1 and 8; fp32 and bf16; ours, ours compiled, transformers sdpa and eager);
# and writes everything to one report file. Exit status: 0 when every test passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-gpu_check_report.txt}
: > "$REPORT"
log() { echo "$@" | tee -a "$REPORT"; }
run() {  # run a command, its output into the report too; returns its status
    log "\$ $*"
    "$@" 2>&1 | tee -a "$REPORT"
    return "${PIPESTATUS[0]}"
}

log "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
PIP=(python -m pip install --quiet)
if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
    PIP+=(--no-index --find-links "$GPU_CHECK_WHEELS")
fi
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    log "torch with CUDA is installed: keeping it, installing the other requirements"
    grep -v '^torch==' requirements.txt > .gpu_check_requirements.txt
    run "${PIP[@]}" -r .gpu_check_requirements.txt
    rm -f .gpu_check_requirements.txt
else
    log "no torch with CUDA here: installing the requirements (torch's CUDA build from the registry or the wheels)"
    run "${PIP[@]}" -r requirements.txt
fi

log ""
log "== machine"
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
run python -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count(), 'transformers', transformers.__version__)"

status=0
log ""
log "== CUDA tests"
run python -m pytest -q -rs -m cuda tests/test_cuda.py || status=1
log ""
log "== the whole suite (CPU tests; the CUDA ones again)"
run python -m pytest -q -rs || status=1

log ""
log "== benchmark on the GPU: ours vs transformers"
run python bench/compare_hf.py --device cuda --only train forward generate --repeats 7 --compile || true

log ""
log "== done: tests $([[ $status == 0 ]] && echo passed || echo FAILED); report in $REPORT"
exit $status
