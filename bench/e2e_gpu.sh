#!/usr/bin/env bash
# End to end on one CUDA GPU with Transformer Engine: upstream's unmodified pretrain_gpt.py
# (mock data, NullTokenizer, TE transformer impl), pristine Megatron-LM vs the fork (the same
# tree with this project's series applied by `python -m mcore_fixes apply`), same seed.
# Observation and injection only through bench/e2e_hook.py. Prints a verdict table; writes
# e2e-verdicts.md, e2e-*.png and e2e-logs.tar.gz (every run's log and step records) into OUT.
#
#   bash bench/e2e_gpu.sh STAGE OUT
#
# Last, `python -m mcore_fixes audit` reads the checkpoints both trees wrote (on CPU) into
# OUT/audit/NAME.{txt,json}: the fp16 + MoE runs saved right after the injected overflow, and
# scenario 2's checkpoints (B: pristine's fp32-norm checkpoint and the fork's).
#
# Run from the project root: its mcore_fixes applies its patches/ to the fork. STAGE is what
# bench/e2e_stage.py writes: mlm-main.tar.gz (`git archive` of Megatron-LM main d98e8a64dd) and
# whl/*.whl (TE and its needs, installed in one `pip install --target` call where `import
# transformer_engine.pytorch` fails). docs/gpu/e2e.md has the procedure.
#
# Scenarios (a run is NAME: tree + hook settings + arguments):
#   1  fp16 + MoE (dense and expert chains, distributed optimizer), one expert-only overflow
#      injected before the optimizer step of iteration S1_INJECT
#   2  bf16, distributed optimizer, fp32 params (mark_keep_in_fp32) in 16-bit groups, torch_dist
#      checkpoints dp_reshardable and fully_reshardable, save at S2_SAVE, resume.
#      A: MoE with fp32 routers (--moe-router-dtype fp64: the router gemm casts both operands),
#      B: dense, an fp32 final LayerNorm (computing in fp32, returning bf16) among norm params
#      of equal size (--disable-bias-linear): pristine can save it (with other params' state),
#      and its checkpoint is resumed on the fork too (the old-checkpoint path), and on the fork
#      with distopt-index-layout reverted (what the resume owes to that patch),
#      C: control without fp32 params
#   3  bf16 Megatron-FSDP v1 + --use-precision-aware-optimizer (TE FusedAdam), the DDP
#      decoupled-grad flag left at its default, vs the same model under DDP
#   4  (where STAGE has mlm-core_v0.19.0.tar.gz) upstream #5077 on the release, pristine vs
#      fork: bf16, distributed optimizer, --overlap-grad-reduce with small buckets whose ends are
#      padded (hidden size 200), fully_reshardable torch_dist checkpoint at S2_SAVE, resume
set -uo pipefail
stage=$(cd "$1" && pwd)
out=$2
here=$(cd "$(dirname "$0")" && pwd) # e2e_hook.py and e2e_report.py beside this script
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=${E2E_WORK:-/tmp/e2e}
S1_INJECT=${S1_INJECT:-10}
S2_SAVE=${S2_SAVE:-10}
ITERS=${E2E_ITERS:-20}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUBLAS_WORKSPACE_CONFIG=:4096:8

if ! python3 -c 'import transformer_engine.pytorch' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/te-site "$stage"/whl/*.whl || exit
    export PYTHONPATH=/tmp/te-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import sys, torch, transformer_engine as te, transformer_engine.pytorch
print(sys.version.split()[0], "torch", torch.__version__, "TE", te.__version__,
      torch.cuda.get_device_name())' \
    | tee "$out/e2e-device.txt" || exit

rm -rf "$work" && mkdir -p "$work/pristine" "$work/runs"
tar xzf "$stage/mlm-main.tar.gz" -C "$work/pristine" || exit
make -s -C "$work/pristine/megatron/core/datasets" >/dev/null || exit # once, before parallel runs
cp -a "$work/pristine" "$work/fork"
(
    cd "$work/fork" && git init -q && git add -A &&
        git -c user.name=e2e -c user.email=e2e@localhost commit -qm pristine
) || exit
python3 -m mcore_fixes apply "$work/fork" --baseline main || exit
git -C "$work/fork" log --format='%h %s' | tee "$out/e2e-series.txt"
# noconv: the fork with distopt-index-layout reverted (found by its patch's subject)
cp -a "$work/fork" "$work/noconv"
subject=$(python3 -c 'import email, sys
print(" ".join(email.message_from_file(open(sys.argv[1]))["Subject"].split()).removeprefix("[PATCH] "))' \
    patches/*-distopt-index-layout.patch) || exit
sha=$(git -C "$work/noconv" log --format='%H %s' | awk -v s="$subject" 'substr($0, 42) == s {print $1}')
[ -n "$sha" ] || { echo "no commit '$subject' in the fork" >&2; exit 1; }
git -C "$work/noconv" -c user.name=e2e -c user.email=e2e@localhost revert --no-edit "$sha" >/dev/null || exit

# scenario 4 needs a release: main has upstream's #5077
rel=core_v0.19.0
if [ -e "$stage/mlm-$rel.tar.gz" ]; then
    mkdir -p "$work/rel-pristine"
    tar xzf "$stage/mlm-$rel.tar.gz" -C "$work/rel-pristine" || exit
    make -s -C "$work/rel-pristine/megatron/core/datasets" >/dev/null || exit
    cp -a "$work/rel-pristine" "$work/rel-fork"
    (
        cd "$work/rel-fork" && git init -q && git add -A &&
            git -c user.name=e2e -c user.email=e2e@localhost commit -qm pristine
    ) || exit
    python3 -m mcore_fixes apply "$work/rel-fork" --baseline $rel || exit
fi

common=(--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
    --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8
    --train-iters "$ITERS" --lr 1e-3 --lr-decay-style constant --seed 1234 --log-interval 1
    --eval-iters 0 --eval-interval 100000 --hidden-dropout 0 --attention-dropout 0
    --position-embedding-type rope --mock-data --tokenizer-type NullTokenizer
    --vocab-size 8192 --transformer-impl transformer_engine --untie-embeddings-and-output-weights
    --no-gradient-accumulation-fusion)
moe=(--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --disable-bias-linear)
fp16=(--fp16 --initial-loss-scale 4096 --loss-scale-window 4 --hysteresis 1 --min-loss-scale 1)
port=29600

# launch NAME TREE "ENV=.. ENV=.." ARGS...: one single-rank training in the background
launch() {
    local name=$1 tree=$2 envs=$3
    shift 3
    port=$((port + 1))
    (
        # shellcheck disable=SC2086
        env $envs E2E_LOG="$work/runs/$name.jsonl" RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
            MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout "${RUN_TIMEOUT:-240}" \
            python3 "$here/e2e_hook.py" "$work/$tree" "${common[@]}" "$@" \
            >"$work/runs/$name.log" 2>&1
        echo $? >"$work/runs/$name.rc"
    ) &
}

fp32router="E2E_FP32_PARAMS=router\.weight$" # MoE routers kept in fp32 (fp64 router math)
router=("${moe[@]}" --moe-router-dtype fp64)
fp32ln="E2E_FP32_PARAMS=final_layernorm\.(weight|bias)$ E2E_FP32_CAST=1"
dist=(--bf16 --use-distributed-optimizer --ckpt-format torch_dist)
full=--dist-ckpt-optim-fully-reshardable
save_args() { echo --save "$work/ckpt/$1" --save-interval "$S2_SAVE"; }
resume_args() { echo --load "$work/ckpt/$1" --ckpt-step "$S2_SAVE"; }

t0=$(date +%s)
# wave 1: runs that need no checkpoint
for tree in pristine fork; do
    launch "s1-$tree" $tree "E2E_INJECT_STEP=$S1_INJECT E2E_EXPERT_PGS=1" "${moe[@]}" "${fp16[@]}" \
        --use-distributed-optimizer
    # the same, saving right after the overflow step (for the audit; s1 itself saves nothing)
    launch "s1-save-$tree" $tree "E2E_INJECT_STEP=$S1_INJECT E2E_EXPERT_PGS=1" "${moe[@]}" \
        "${fp16[@]}" --use-distributed-optimizer --ckpt-format torch_dist \
        --save "$work/ckpt/s1-$tree" --save-interval "$S1_INJECT"
    for fmt in dp full; do
        extra=()
        [ $fmt = full ] && extra=($full)
        # shellcheck disable=SC2046
        launch "s2a-$fmt-$tree" $tree "$fp32router" "${router[@]}" "${dist[@]}" "${extra[@]}" \
            $(save_args "a-$fmt-$tree")
        # shellcheck disable=SC2046
        launch "s2b-$fmt-$tree" $tree "$fp32ln" --disable-bias-linear "${dist[@]}" "${extra[@]}" \
            $(save_args "b-$fmt-$tree")
    done
    # shellcheck disable=SC2046
    launch "s2c-dp-$tree" $tree "" "${dist[@]}" $(save_args "c-dp-$tree")
    launch "s3-fsdp-$tree" $tree "E2E_FSDP_FLAG_DEFAULT=1" --bf16 --use-megatron-fsdp \
        --data-parallel-sharding-strategy optim_grads_params --use-precision-aware-optimizer \
        --ckpt-format fsdp_dtensor
done
launch "s3-ddp-fork" fork "" --bf16 --use-distributed-optimizer --use-precision-aware-optimizer
# hidden 200: no layer's grads fill a multiple of 128 elements, so each bucket ends in padding
padded=(--hidden-size 200 --num-attention-heads 5 --ffn-hidden-size 800 --overlap-grad-reduce
    --ddp-bucket-size 400000 "${dist[@]}" $full)
if [ -d "$work/rel-fork" ]; then
    for tree in rel-pristine rel-fork; do
        # shellcheck disable=SC2046
        launch "s4-$tree" $tree "" "${padded[@]}" $(save_args "d-$tree")
    done
fi
wait
t1=$(date +%s)
# wave 2: resumes (RNG, data position and optimizer state from the checkpoint of step S2_SAVE)
for tree in pristine fork; do
    for fmt in dp full; do
        extra=()
        [ $fmt = full ] && extra=($full)
        [ "$(cat "$work/runs/s2a-$fmt-$tree.rc")" = 0 ] || continue # its save failed
        # shellcheck disable=SC2046
        launch "s2a-$fmt-$tree-resumed" $tree "$fp32router" "${router[@]}" "${dist[@]}" \
            "${extra[@]}" $(resume_args "a-$fmt-$tree")
    done
    for fmt in dp full; do
        extra=()
        [ $fmt = full ] && extra=($full)
        [ "$(cat "$work/runs/s2b-$fmt-$tree.rc")" = 0 ] || continue
        # shellcheck disable=SC2046
        launch "s2b-$fmt-$tree-resumed" $tree "$fp32ln" --disable-bias-linear "${dist[@]}" \
            "${extra[@]}" $(resume_args "b-$fmt-$tree")
        # the checkpoint pristine wrote, resumed on the fork (a checkpoint of earlier versions)
        # shellcheck disable=SC2046
        [ $tree = pristine ] && launch "s2b-$fmt-fork-from-pristine" fork "$fp32ln" \
            --disable-bias-linear "${dist[@]}" "${extra[@]}" $(resume_args "b-$fmt-pristine")
        # the same on the fork without distopt-index-layout
        # shellcheck disable=SC2046
        [ $tree = pristine ] && launch "s2b-$fmt-noconv-from-pristine" noconv "$fp32ln" \
            --disable-bias-linear "${dist[@]}" "${extra[@]}" $(resume_args "b-$fmt-pristine")
        # the other way: the checkpoint the fork wrote, resumed on pristine (going back to
        # upstream): it must load exactly or fail with an error, never permuted
        # shellcheck disable=SC2046
        [ $tree = fork ] && launch "s2b-$fmt-pristine-from-fork" pristine "$fp32ln" \
            --disable-bias-linear "${dist[@]}" "${extra[@]}" $(resume_args "b-$fmt-fork")
    done
    # shellcheck disable=SC2046
    launch "s2c-dp-$tree-resumed" $tree "" "${dist[@]}" $(resume_args "c-dp-$tree")
done
for tree in rel-pristine rel-fork; do
    # shellcheck disable=SC2046
    [ "$(cat "$work/runs/s4-$tree.rc" 2>/dev/null)" = 0 ] &&
        launch "s4-$tree-resumed" $tree "" "${padded[@]}" $(resume_args "d-$tree")
done
wait
t2=$(date +%s)
echo "wave 1: $((t1 - t0)) s, wave 2: $((t2 - t1)) s" | tee "$out/e2e-timing.txt"

# audit: every checkpoint named below, as written (exit status 1: damage found)
mkdir -p "$out/audit"
for tree in pristine fork; do
    ckpts=("s1-$tree:$work/ckpt/s1-$tree/iter_$(printf %07d "$S1_INJECT")")
    for fmt in dp full; do
        ckpts+=("b-$fmt-$tree:$work/ckpt/b-$fmt-$tree" "a-$fmt-$tree:$work/ckpt/a-$fmt-$tree")
    done
    ckpts+=("c-dp-$tree:$work/ckpt/c-dp-$tree")
    [ -d "$work/ckpt/d-rel-$tree" ] && ckpts+=("d-rel-$tree:$work/ckpt/d-rel-$tree")
    for entry in "${ckpts[@]}"; do
        name=${entry%%:*} path=${entry#*:}
        python3 -m mcore_fixes audit "$path" >"$out/audit/$name.txt" 2>&1
        echo $? >"$out/audit/$name.rc"
        python3 -m mcore_fixes audit "$path" --json >"$out/audit/$name.json" 2>/dev/null
    done
done
t3=$(date +%s)
echo "audit: $((t3 - t2)) s" | tee -a "$out/e2e-timing.txt"

python3 "$here/e2e_report.py" "$work/runs" "$out" --inject "$S1_INJECT" --save "$S2_SAVE"
rc=$?
tar czf "$out/e2e-logs.tar.gz" -C "$work" runs
exit $rc
