#!/usr/bin/env bash
# The series' carried tests on patched main with Transformer Engine 2.20.2 (one GPU).
# Run from the project root on the GPU machine with .gpu/ staged: .gpu/whl/*.whl (TE and its
# needs, as bench/e2e_stage.py stages them), .gpu/suites/whl/mock-*.whl and
# .gpu/suites/mlm-main.tar.gz (`git archive d98e8a64dd megatron tests/unit_tests tests/test_utils
# tests/__init__.py examples *_builders.py model_provider.py pretrain_gpt.py pyproject.toml`).
# Writes $OUT/te-carried.log and .xml. The -k list is every test function the patches add.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0
proj=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl .gpu/suites/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -c 'import torch, transformer_engine as t, transformer_engine.pytorch; print("torch", torch.__version__, "TE", t.__version__, torch.cuda.get_device_name())' 2>&1 | tee $OUT/te-carried.log
mkdir -p /tmp/mlm /opt/data; touch /opt/data/.placeholder
tar xzf .gpu/suites/mlm-main.tar.gz -C /tmp/mlm
cd /tmp/mlm && git init -q && git add -A && git -c user.name=x -c user.email=x@x commit -qm "main d98e8a64dd (archive)"
cd "$proj" && GIT_AUTHOR_NAME=x GIT_AUTHOR_EMAIL=x@x GIT_COMMITTER_NAME=x GIT_COMMITTER_EMAIL=x@x python3 -m mcore_fixes apply /tmp/mlm --baseline main 2>&1 | tee -a $OUT/te-carried.log
cd /tmp/mlm && git log --oneline | head -12 >> $OUT/te-carried.log
PYTHONPATH=/tmp/mlm:/tmp/site timeout ${T:-170} torchrun --nproc_per_node=1 -m pytest -q -p no:cacheprovider -o addopts= -rA \
  tests/unit_tests/test_optimizer.py tests/unit_tests/dist_checkpointing/test_optimizer.py \
  tests/unit_tests/models/mimo/test_mimo_optimizer_consensus.py tests/unit_tests/models/mimo/test_mimo_optimizer.py \
  tests/unit_tests/optimizer/test_clip_grads.py \
  tests/unit_tests/distributed/mfsdp_v1/test_mcore_fully_sharded_data_parallel.py \
  -k "test_chained_count_zeros_makes_one_reduction_whatever_each_rank_owns or test_chained_optimizer_overflow_in_one_chain_backs_off_every_loss_scale or test_chained_optimizer_reconciles_diverged_loss_scalers_on_load or test_chained_optimizer_runs_each_prepare_grads_once or test_chained_optimizer_updates_a_shared_loss_scaler_once or test_checkpoint_loads_exactly or test_checkpoint_records_its_layout or test_unrecorded_equal_values_load_in_grad_buffer_order or test_chunks_sharing_a_ddp_config_each_follow_their_optimizer or test_clip_reads_gradients_where_the_module_optimizer_reads or test_clip_without_grads_skips_multi_tensor_applier or test_decoupled_grad_flag_contradicting_the_optimizer_raises or test_decoupled_grad_follows_the_precision_aware_optimizer or test_distrib_optimizer_dp_zero_round_trip_without_per_param_step or test_distrib_optimizer_load_gives_each_param_its_own_step or test_distrib_optimizer_missing_state_key_raises or test_diverged_loss_scalers_are_reconciled_after_load or test_dp_reshardable_round_trip_is_bit_exact or test_fp16_unscales_the_gradients_the_optimizer_reads or test_grad_readers_accept_duck_typed_chained_optimizers or test_grad_readers_follow_the_optimizer_decoupled_grad or test_grads_go_and_are_read_where_the_optimizer_reads or test_load_skipped_on_stub_ranks_does_not_hang or test_overflow_in_one_grid_backs_off_every_loss_scale or test_overflow_in_one_module_backs_off_every_loss_scale or test_param_index_points_at_own_shard" --junitxml=$OUT/te-carried.xml > /tmp/pytest.log 2>&1; rc=$?
tail -120 /tmp/pytest.log >> $OUT/te-carried.log
echo "pytest exit $rc" >> $OUT/te-carried.log
