# Source: github.com/verl-project/verl-recipe dapo/dapo_transfer_queue/30B_megatron_dapo_npu.sh @ 48ea0a797fa29867ea0ad92aff7d284eec7d4be3 (DAPO + TransferQueue recipe, config dapo_transfer_queue_trainer.yaml); verbatim below.
#!/usr/bin/env bash
set -x
# 0. download the config
# only need to download the configuration_deepseek.py and config.json
# remove the `quantization_config` in the `config.json`
# set `num_nextn_predict_layers=0` to disable MTP, which is not currently supported
# huggingface-cli download deepseek-ai/DeepSeek-V3-0324 configuration_deepseek.py config.json

# You may try to enable zero-copy serialization for TransferQueue when using SimpleStorageUnit backend.
export TQ_ZERO_COPY_SERIALIZATION=False
project_name='qwen3-30b-a3b-megatron'
exp_name='DAPO'

adv_estimator=grpo

use_kl_in_reward=False
kl_coef=0.0
use_kl_loss=False
kl_loss_coef=0.0

clip_ratio_low=0.2
clip_ratio_high=0.28

enable_filter_groups=True
max_num_gen_batches=30
filter_groups_metric=acc
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 20))
enable_overlong_buffer=True
overlong_buffer_len=$((256 * 1))
overlong_penalty_factor=1.0

loss_agg_mode="token-mean"

train_prompt_bsz=8 # must be > n_gpus. need to fix
gen_prompt_bsz=$((train_prompt_bsz * 1))
n_resp_per_prompt=8
train_prompt_mini_bsz=8 # mini_bsz * n >= micro_bsz * pp * dp

# 支持通过环境变量覆盖，例如: export MODEL_PATH=/path/to/model && ./30B_megatron_dapo_npu.sh
MODEL_PATH="${MODEL_PATH:-/workspace/models/Qwen3-30B-A3B}"
MCORE_MODEL_PATH="${MCORE_MODEL_PATH:-/workspace/mcore/Qwen3-30B-A3B}"
TRAIN_FILE="${TRAIN_FILE:-/workspace/database/dapo-math-17k.parquet}"
TEST_FILE="${TEST_FILE:-/workspace/database/dapo-math-17k.parquet}"

CKPTS_DIR="./ckpts/${project_name}/${exp_name}-$(date +"%Y-%m-%dTime%H.%M.%S")"


# Algorithm 
temperature=1.0
top_p=1.0
top_k=-1 # 0 for HF rollout, -1 for vLLM rollout
val_top_p=0.7

# Performance Related Parameter
use_dynamic_bsz=True

offload=True

gen_tp=4

enable_expert_parallel=True


rollout_max_num_seqs=512
max_num_batched_tokens=$((1024 * 2))
train_tp=4
train_ep=1
train_pp=4
train_cp=1

actor_ppo_max_token_len=$((max_prompt_length + max_response_length))
infer_ppo_max_token_len=$((max_prompt_length + max_response_length))
actor_ppo_max_token_len=$((actor_ppo_max_token_len / train_cp))
infer_ppo_max_token_len=$((infer_ppo_max_token_len / train_cp))
# "dapo_trainer-megatron"
ray job submit --no-wait \
    -- python3 -m recipe.dapo.dapo_transfer_queue.main_dapo \
        --config-name="dapo_transfer_queue_trainer" \
        data.train_files="${TRAIN_FILE}" \
        data.val_files="${TEST_FILE}" \
        data.prompt_key=prompt \
        data.truncation='left' \
        data.max_prompt_length=${max_prompt_length} \
        data.max_response_length=${max_response_length} \
        data.train_batch_size=${train_prompt_bsz} \
        data.gen_batch_size=${gen_prompt_bsz} \
        actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
        algorithm.adv_estimator=${adv_estimator} \
        algorithm.use_kl_in_reward=${use_kl_in_reward} \
        algorithm.kl_ctrl.kl_coef=${kl_coef} \
        actor_rollout_ref.actor.use_kl_loss=${use_kl_loss} \
        actor_rollout_ref.actor.kl_loss_coef=${kl_loss_coef} \
        actor_rollout_ref.actor.clip_ratio_low=${clip_ratio_low} \
        actor_rollout_ref.actor.clip_ratio_high=${clip_ratio_high} \
        actor_rollout_ref.actor.clip_ratio_c=10.0 \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
        algorithm.filter_groups.enable=${enable_filter_groups} \
        algorithm.filter_groups.max_num_gen_batches=${max_num_gen_batches} \
        algorithm.filter_groups.metric=${filter_groups_metric} \
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 \
        actor_rollout_ref.model.path="${MODEL_PATH}" \
        actor_rollout_ref.actor.optim.lr=1e-6 \
        actor_rollout_ref.actor.optim.weight_decay=0.1 \
        actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
        actor_rollout_ref.actor.megatron.param_offload=${offload} \
        actor_rollout_ref.actor.megatron.optimizer_offload=${offload} \
        actor_rollout_ref.actor.megatron.grad_offload=${offload} \
        actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=${train_pp} \
        actor_rollout_ref.actor.megatron.tensor_model_parallel_size=${train_tp} \
        actor_rollout_ref.actor.megatron.expert_model_parallel_size=${train_ep} \
        actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=${train_tp} \
        actor_rollout_ref.actor.megatron.context_parallel_size=${train_cp} \
        +actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_size=${train_cp} \
        actor_rollout_ref.actor.megatron.dist_checkpointing_path=${MCORE_MODEL_PATH} \
        actor_rollout_ref.actor.megatron.use_dist_checkpointing=True \
        +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform \
        +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full \
        +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1 \
        actor_rollout_ref.actor.entropy_coeff=0 \
        actor_rollout_ref.actor.use_dynamic_bsz=${use_dynamic_bsz} \
        actor_rollout_ref.ref.log_prob_use_dynamic_bsz=${use_dynamic_bsz} \
        actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=${use_dynamic_bsz} \
        ++actor_rollout_ref.model.use_remove_padding=True \
        actor_rollout_ref.actor.loss_agg_mode=${loss_agg_mode} \
        actor_rollout_ref.rollout.disable_log_stats=False \
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
        actor_rollout_ref.rollout.tensor_model_parallel_size=${gen_tp} \
        actor_rollout_ref.rollout.load_format="safetensors" \
        actor_rollout_ref.rollout.enable_chunked_prefill=False \
        actor_rollout_ref.rollout.enforce_eager=True \
        actor_rollout_ref.rollout.max_num_batched_tokens=${max_num_batched_tokens} \
        actor_rollout_ref.rollout.max_model_len=$((max_prompt_length + max_response_length)) \
        actor_rollout_ref.rollout.max_num_seqs=${rollout_max_num_seqs} \
        actor_rollout_ref.rollout.temperature=${temperature} \
        actor_rollout_ref.rollout.top_p=${top_p} \
        actor_rollout_ref.rollout.top_k=${top_k} \
        actor_rollout_ref.rollout.val_kwargs.temperature=${temperature} \
        actor_rollout_ref.rollout.val_kwargs.top_p=${val_top_p} \
        actor_rollout_ref.rollout.val_kwargs.top_k=${top_k} \
        actor_rollout_ref.rollout.val_kwargs.do_sample=True \
        actor_rollout_ref.rollout.val_kwargs.n=1 \
        actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=${train_pp} \
        actor_rollout_ref.ref.megatron.tensor_model_parallel_size=${train_tp} \
        actor_rollout_ref.ref.megatron.expert_model_parallel_size=${train_ep} \
        actor_rollout_ref.ref.megatron.param_offload=${offload} \
        actor_rollout_ref.ref.megatron.dist_checkpointing_path=${MCORE_MODEL_PATH} \
        reward_model.reward_manager=dapo \
        +reward_model.reward_kwargs.overlong_buffer_cfg.enable=${enable_overlong_buffer} \
        +reward_model.reward_kwargs.overlong_buffer_cfg.len=${overlong_buffer_len} \
        +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=${overlong_penalty_factor} \
        +reward_model.reward_kwargs.overlong_buffer_cfg.log=False \
        +reward_model.reward_kwargs.max_resp_len=${max_response_length} \
        trainer.logger=['console'] \
        trainer.project_name="${project_name}" \
        trainer.experiment_name="${exp_name}" \
        trainer.n_gpus_per_node=16 \
        trainer.nnodes=1 \
        trainer.device=npu \
        trainer.val_before_train=False \
        trainer.test_freq=-1 \
        trainer.save_freq=100 \
        trainer.total_epochs=1 \
        trainer.total_training_steps=100 \
        trainer.default_local_dir="${CKPTS_DIR}" \
        trainer.resume_mode=auto \
        trainer.log_val_generations=-1 \
        actor_rollout_ref.rollout.name=vllm \
        actor_rollout_ref.nccl_timeout=7200 \
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_ppo_max_token_len} \
        actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${infer_ppo_max_token_len} \
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${infer_ppo_max_token_len} \
        +actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=True \
        ++actor_rollout_ref.ref.megatron.override_transformer_config.use_flash_attn=True