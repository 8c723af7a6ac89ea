#!/bin/bash
# Megatron-LM GPT pretraining (examples/gpt3/train_gpt3_175b_distributed.sh style)
GPUS_PER_NODE=8
GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
    --lr 6.0e-5
    --bf16
    --use-precision-aware-optimizer
    --main-params-dtype fp32
    --exp-avg-dtype bf16
    --exp-avg-sq-dtype bf16
)
torchrun --nproc_per_node $GPUS_PER_NODE pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    --tensor-model-parallel-size 1
