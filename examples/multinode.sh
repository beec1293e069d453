#!/usr/bin/env bash
# Multi-node training: run this same line on every node, each with its own NODE_RANK.
#
#   node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh model.path=/ckpt/Qwen2.5-1.5B [overrides...]
#   node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh model.path=/ckpt/Qwen2.5-1.5B [overrides...]
#
# NNODES (default 2) nodes x GPUS (default 8) processes form one world. parallel.tp=T splits each model over T
# consecutive ranks (keep T <= GPUS so a tensor-parallel group never crosses nodes); the rest is data parallel,
# so trainer.prompts_per_step must be divisible by NNODES * GPUS / T. parallel.dp_replicate=NNODES makes each node
# hold one replica of the sharded model (hybrid sharding, docs/training.md#launch): parameters are gathered within
# a node and only the sharded gradients cross between nodes.
#
# MASTER_ADDR must be reachable from every node; MASTER_PORT (default 29500) must be free on node 0.
# trainer.output_dir must be on a filesystem every node sees: all ranks write their checkpoint shards there
# (node 0 alone writes metrics.jsonl, config.yaml and hf/). With NCCL over several network interfaces, set
# NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) to the one the nodes share.
#
# The same launch works on one machine with two "nodes" (MASTER_ADDR=127.0.0.1, GPUS=1, parallel.device=cpu):
# tests/distributed/test_multinode.py does exactly that.
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK (0 on the master node, 1..NNODES-1 elsewhere)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
NNODES=${NNODES:-2}
GPUS=${GPUS:-8}
MASTER_PORT=${MASTER_PORT:-29500}

exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS" \
  --rdzv-backend=static --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
  -m sparserl.trainer.grpo "$@"
