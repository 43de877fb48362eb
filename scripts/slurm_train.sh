#!/bin/bash
# Multi-host training under SLURM: one task per node, all of the node's GPUs per task.
#   sbatch scripts/slurm_train.sh configs/1b.py /ckpt/1b-mhar [--config.key=value ...]
#SBATCH --job-name=mhar
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --signal=TERM@120          # SIGTERM 2 min before the limit: save and exit 0
#SBATCH --requeue
set -euo pipefail
CONFIG=${1:?config file}; WORKDIR=${2:?workdir}; shift 2
# jax.distributed is initialised from SLURM_* (coordinator: first host of the
# step's node list); resubmitting the same command resumes from WORKDIR.
srun --kill-on-bad-exit=1 python -m mhar_jax.train \
  --config="$CONFIG" --workdir="$WORKDIR" --config.mesh.data=-1 "$@"
