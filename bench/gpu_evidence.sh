#!/usr/bin/env bash
# GPU evidence for docs/evidence.md, on a machine with one CUDA GPU (torch, pytest installed).
# Run from a clone in which the trees exist (`python -m mcore_fixes status --mcore-repo PATH`
# materializes build/trees/<baseline>; or carry build/trees to the GPU machine):
#
#   bash bench/gpu_evidence.sh prove main 0.16.1   # fail-before / pass-after, GPU tests included
#   bash bench/gpu_evidence.sh bench main          # run-time cost, patched vs pristine
#
# Logs and proof records go to ${OUT:-build/gpu-evidence}.
set -uo pipefail
out=${OUT:-build/gpu-evidence}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
phase=$1
shift
$py -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$out/device.txt"

case $phase in
prove)
    for b in "$@"; do
        $py -m mcore_fixes prove --baseline "$b" --markdown 2>&1 | tee "$out/prove-$b.md"
        cp "build/proofs/$b.json" "$out/proofs-$b.json"
    done
    ;;
bench)
    b=${1:-main}
    tmp=$(mktemp -d)
    git clone -q "build/trees/$b" "$tmp/patched"
    git clone -q "build/trees/$b" "$tmp/pristine" && git -C "$tmp/pristine" checkout -q pristine
    trees=(--patched "$tmp/patched" --pristine "$tmp/pristine")
    $py bench/bench_distopt_index.py "${trees[@]}" 2>&1 | tee "$out/bench-distopt-$b.txt"
    if [ -e "$tmp/patched/megatron/core/models/mimo" ]; then
        $py bench/bench_mimo.py "${trees[@]}" --device cuda 2>&1 | tee "$out/bench-mimo-$b.txt"
    fi
    if [ -e bench/bench_fsdp.py ]; then
        $py bench/bench_fsdp.py "${trees[@]}" 2>&1 | tee "$out/bench-fsdp-$b.txt"
    fi
    ;;
*)
    echo "usage: $0 prove BASELINE... | bench BASELINE" >&2
    exit 2
    ;;
esac
