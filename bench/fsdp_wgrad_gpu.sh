#!/usr/bin/env bash
# Megatron-FSDP's fused weight-gradient accumulation on one CUDA GPU with Transformer Engine:
# upstream's unmodified pretrain_gpt.py (mock data, NullTokenizer, bf16, 4 layers, hidden 576,
# 4 microbatches per step at data-parallel size 1), on core_v0.19.0 and main, pristine vs the
# fork (the same tree with this project's series applied by `python -m mcore_fixes apply`).
#
#   bash bench/fsdp_wgrad_gpu.sh STAGE OUT
#
# Each Megatron-FSDP run (--use-megatron-fsdp --data-parallel-sharding-strategy optim|no_shard)
# trains twice from the same seed: with gradient accumulation fusion (the default: TE's layers
# and the output layer write weight gradients straight into main_grad) and with
# --no-gradient-accumulation-fusion (autograd's .grad, accumulated by Megatron-FSDP: the
# reference). The verdict is the largest loss gap between the two over the run, next to the
# same gap under DDP (--use-distributed-optimizer), the yardstick of what fusion alone changes
# (bf16 rounding). Without the fixes the fused run drops microbatches: upstream #6357 (TE's
# layers under optim) and the output layer's ColumnParallelLinear (under optim and no_shard).
# Prints the table and writes it to OUT/fsdp-wgrad.md (bench/fsdp_wgrad_report.py, with the plot
# OUT/fsdp-wgrad.png), every run's log to OUT/logs/. Then, on
# main's fork, the carried upstream tests of fix 6 and #5071 (OUT/logs/carried-tests.log).
#
# STAGE is what bench/e2e_stage.py writes (whl/*.whl: TE and its needs; mlm-main.tar.gz:
# Megatron-LM main d98e8a64dd), plus mlm-core_v0.19.0.tar.gz:
#
#   git -C ~/Megatron-LM archive --format=tar.gz core_v0.19.0 megatron pretrain_gpt.py \
#       gpt_builders.py model_provider.py tests/unit_tests > STAGE/mlm-core_v0.19.0.tar.gz
#
# Where apex's fused_weight_gradient_mlp_cuda is missing (the DDP runs' output layer needs it
# with fusion on; Megatron-FSDP's branch never calls it), a torch stand-in is put on the path
# (fp32 accumulation of grad_output^T @ input into main_grad, as the extension does).
# Run from the project root. Knobs: ITERS (10), RUN_TIMEOUT per run (300 s), FSDP_WORK
# (/tmp/fsdp-wgrad), TREES ("core_v0.19.0 main"), TIE (0; 1: GPT's default tied embedding and
# output weights instead of --untie-embeddings-and-output-weights, written as
# OUT/fsdp-wgrad-tied.md and .png).
set -uo pipefail
stage=$(cd "$1" && pwd)
out=$2
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
work=${FSDP_WORK:-/tmp/fsdp-wgrad}
ITERS=${ITERS:-10}
TREES=${TREES:-"core_v0.19.0 main"}
TIE=${TIE:-0}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUBLAS_WORKSPACE_CONFIG=:4096:8

if ! python3 -c 'import transformer_engine.pytorch' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/te-site "$stage"/whl/*.whl || exit
    export PYTHONPATH=/tmp/te-site${PYTHONPATH:+:$PYTHONPATH}
fi
rm -rf "$work" && mkdir -p "$work/runs" "$work/standin"
if ! python3 -c 'import fused_weight_gradient_mlp_cuda' 2>/dev/null; then
    cat >"$work/standin/fused_weight_gradient_mlp_cuda.py" <<'EOF'
"""Stand-in for apex's fused_weight_gradient_mlp_cuda (bench/fsdp_wgrad_gpu.sh)."""
import torch


def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
    main_grad.add_(grad_output.float().t().matmul(total_input.float()))


def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
    main_grad.add_(grad_output.t().matmul(total_input))
EOF
    export PYTHONPATH=$work/standin${PYTHONPATH:+:$PYTHONPATH}
    echo "apex's fused_weight_gradient_mlp_cuda: torch stand-in" | tee "$out/fsdp-wgrad-device.txt"
fi
python3 -c 'import sys, torch, transformer_engine as te, transformer_engine.pytorch
print(sys.version.split()[0], "torch", torch.__version__, "TE", te.__version__,
      torch.cuda.get_device_name())' | tee -a "$out/fsdp-wgrad-device.txt" || exit

for base in $TREES; do
    archive=$stage/mlm-$base.tar.gz
    [ "$base" = main ] && archive=$stage/mlm-main.tar.gz
    mkdir -p "$work/$base-pristine" && tar xzf "$archive" -C "$work/$base-pristine" || exit
    make -s -C "$work/$base-pristine/megatron/core/datasets" >/dev/null || exit
    cp -a "$work/$base-pristine" "$work/$base-fork"
    (
        cd "$work/$base-fork" && git init -q && git add -A &&
            git -c user.name=bench -c user.email=bench@localhost commit -qm pristine
    ) || exit
    python3 -m mcore_fixes apply "$work/$base-fork" --baseline "$base" >"$out/logs/apply-$base.txt" 2>&1 ||
        { cat "$out/logs/apply-$base.txt"; exit 1; }
    git -C "$work/$base-fork" log --format='%h %s' >>"$out/logs/apply-$base.txt"
done

common=(--num-layers 4 --hidden-size 576 --ffn-hidden-size 2304 --num-attention-heads 8
    --seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 8
    --train-iters "$ITERS" --lr 3e-4 --lr-decay-style constant --seed 1234 --log-interval 1
    --eval-iters 0 --eval-interval 100000 --hidden-dropout 0 --attention-dropout 0
    --position-embedding-type rope --mock-data --tokenizer-type NullTokenizer --vocab-size 8192
    --transformer-impl transformer_engine --bf16)
[ "$TIE" = 1 ] || common+=(--untie-embeddings-and-output-weights)
port=29700
launch() { # NAME TREE ARGS...: one single-rank training in the background
    local name=$1 tree=$2
    shift 2
    port=$((port + 1))
    (
        cd "$work/$tree" &&
            RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
                timeout "${RUN_TIMEOUT:-300}" python3 pretrain_gpt.py "${common[@]}" "$@" \
                >"$work/runs/$name.log" 2>&1
        echo $? >"$work/runs/$name.rc"
    ) &
}

t0=$(date +%s)
for base in $TREES; do
    for side in pristine fork; do
        for strategy in optim no_shard; do
            fsdp=(--use-megatron-fsdp --data-parallel-sharding-strategy "$strategy"
                --ckpt-format fsdp_dtensor)
            launch "$base-$side-$strategy-fused" "$base-$side" "${fsdp[@]}"
            launch "$base-$side-$strategy-unfused" "$base-$side" "${fsdp[@]}" \
                --no-gradient-accumulation-fusion
        done
    done
    launch "$base-pristine-ddp-fused" "$base-pristine" --use-distributed-optimizer
    launch "$base-pristine-ddp-unfused" "$base-pristine" --use-distributed-optimizer \
        --no-gradient-accumulation-fusion
    wait # one wave per Megatron-LM tree: 10 runs at once
done
t1=$(date +%s)
echo "runs: $((t1 - t0)) s" | tee "$out/fsdp-wgrad-timing.txt"
cp "$work"/runs/* "$out/logs/"

# The carried upstream tests on the fork of main, one rank (mlm-main.tar.gz has tests/unit_tests):
# fix 6's (fused vs unfused Megatron-FSDP grads) and #5071's (test_optimizer_cpu_offloading.py).
if [ -d "$work/main-fork/tests/unit_tests" ]; then
    mkdir -p /opt/data # upstream's conftest downloads test data where /opt/data is missing
    (
        cd "$work/main-fork" &&
            PYTHONPATH=$work/main-fork${PYTHONPATH:+:$PYTHONPATH} timeout 300 \
                torchrun --nproc_per_node=1 -m pytest -q -p no:cacheprovider -o addopts= -rA \
                tests/unit_tests/distributed/mfsdp_v1/test_mfsdp_fused_wgrad_accumulation.py \
                $(ls tests/unit_tests/distributed/mfsdp_v1/test_mfsdp_tied_*.py 2>/dev/null) \
                tests/unit_tests/test_optimizer_cpu_offloading.py -k "fused or reload or hdo" \
                >"$out/logs/carried-tests.log" 2>&1
        echo "carried upstream tests (fix 6, #5071) on main's fork: pytest exit $?"
    ) | tee -a "$out/fsdp-wgrad-timing.txt"
fi

if [ "$TIE" = 1 ]; then
    python3 "$(dirname "$0")/fsdp_wgrad_report.py" "$work/runs" "$out" --trees "$TREES" \
        --name fsdp-wgrad-tied --note "tied embedding and output weights"
else
    python3 "$(dirname "$0")/fsdp_wgrad_report.py" "$work/runs" "$out" --trees "$TREES"
fi
