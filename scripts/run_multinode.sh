#!/usr/bin/env bash
# scripts/run_multinode.sh: the GPT-2 124M run of scripts/run_gpt2_124M.sh, or the 8x124M Switch MoE run of
# scripts/run_moe_8x124M.sh, across several nodes: one process per GPU, started by Open MPI's mpirun from a
# hostfile, NCCL between the GPUs (-pi mpi: rank and local GPU come from Open MPI). Same flags, data and
# tokens per step as the single-node scripts, so the curves match; more GPUs only mean less accumulation.
# Resumable: it loops with -y 1 until the last step's DONE marker exists. Pre-empted (SIGUSR1 to mpirun, which
# forwards it to every rank: under Slurm sbatch --signal=B:USR1@120 and a trap in the batch script that passes it on,
# doc/training.md) the trainer writes a checkpoint at the next step and exits 138; the next attempt, or a requeued
# job, goes on from it.
#
#   scripts/run_multinode.sh HOSTFILE [gpt2|moe]          (default gpt2)
#
# HOSTFILE is an Open MPI hostfile, one node a line: "node1 slots=8". Needs, on every node, the same path
# to this repository (the built binary), to its data/ and to the output directory: a shared file system,
# since every rank reads the shards and writes its own optimizer-state file and rank 0 the model and DONE
# marker that -y 1 resumes from. mpirun reaches the other nodes by ssh (without a password).
# Environment: GPUS_PER_NODE (8), B micro-batch per GPU (64 gpt2, 32 moe), EP expert-parallel degree (moe,
# 1), OUT (build/log_gpt2_124M_multinode or build/log_moe_8x124M_multinode), DATA (data/fineweb_edu_10B),
# USE_CUDNN (1), MAX_FAILURES (3). NCCL_* variables set here (e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA) are
# passed to every rank.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: scripts/run_multinode.sh HOSTFILE [gpt2|moe]" >&2
    exit 1
fi
hostfile=$1
model=${2:-gpt2}
steps=18865
data=${DATA:-data/fineweb_edu_10B}
gpus_per_node=${GPUS_PER_NODE:-8}
max_failures=${MAX_FAILURES:-3}
case "$model" in
    gpt2)
        trainer=train_gpt
        micro_batch=${B:-64}
        out_dir=${OUT:-build/log_gpt2_124M_multinode}
        model_flags=() ;;
    moe)
        trainer=train_moe
        micro_batch=${B:-32}
        out_dir=${OUT:-build/log_moe_8x124M_multinode}
        model_flags=(-ne 8 -tk 1 -me 2 -eh 3072 -cf 1.25 -cfe 2.0 -ra 0.01 -rz 0.001 -ep "${EP:-1}") ;;
    *)
        echo "run_multinode.sh: model '$model': expected gpt2 or moe" >&2
        exit 1 ;;
esac
if [ ! -r "$hostfile" ]; then
    echo "run_multinode.sh: cannot read the hostfile $hostfile" >&2
    exit 1
fi
# nodes: the hostfile's lines that are neither blank nor comments
nodes=$(grep -cvE '^[[:space:]]*(#|$)' "$hostfile" || true)
if [ "$nodes" -lt 1 ]; then
    echo "run_multinode.sh: $hostfile names no node (expected lines like 'node1 slots=8')" >&2
    exit 1
fi
for value in "$gpus_per_node" "$micro_batch"; do
    if ! [[ "$value" =~ ^[1-9][0-9]*$ ]]; then
        echo "run_multinode.sh: GPUS_PER_NODE='$gpus_per_node' B='$micro_batch': expected positive counts" >&2
        exit 1
    fi
done
if ! compgen -G "$data/fineweb_edu_10B_gpt2_train_*.bin" >/dev/null || [ ! -f "$data/gpt2_tokenizer.bin" ]; then
    echo "run_multinode.sh: no GPT-2 shards in $data: run /usr/bin/python3 data/fineweb.py first" >&2
    exit 1
fi
make "$trainer" USE_CUDNN="${USE_CUDNN:-1}"
nprocs=$((nodes * gpus_per_node))
echo "run_multinode.sh: $model on $nodes nodes x $gpus_per_node GPUs = $nprocs processes, output in $out_dir"

# Open MPI refuses to run as root (containers on GPU machines often are) unless told it is meant
mpirun_root=()
[ "$(id -u)" -eq 0 ] && mpirun_root=(--allow-run-as-root)
# the remote ranks get this node's PATH and library path (CUDA, NCCL) and any NCCL tuning set here
env_flags=(-x PATH -x LD_LIBRARY_PATH)
for name in $(compgen -e | grep '^NCCL_' || true); do
    env_flags+=(-x "$name")
done
# the newest DONE marker, or nothing (ls fails when there is none yet: not an error under pipefail)
latest_done() { { ls "$out_dir"/DONE_* 2>/dev/null || true; } | sort | tail -n 1; }
done_file=$out_dir/DONE_$(printf '%08d' "$steps")
failures=0
while [ ! -f "$done_file" ]; do
    before=$(latest_done)
    # --bind-to none: the trainer's CPU threads are few and the GPU does the work; ppr: GPUS_PER_NODE per node
    mpirun "${mpirun_root[@]}" -np "$nprocs" --hostfile "$hostfile" --map-by "ppr:$gpus_per_node:node" \
        --bind-to none "${env_flags[@]}" "./$trainer" \
        -e d12 -i "$data/fineweb_edu_10B_gpt2_train_*.bin" -j "$data/fineweb_edu_10B_gpt2_val_*.bin" \
        -tf "$data/gpt2_tokenizer.bin" -o "$out_dir" \
        -b "$micro_batch" -t 1024 -d 524288 -x "$steps" \
        -l 0.0006 -u 700 -q 0.0 -k cosine -c 0.1 \
        -v 250 -m 20 -s 20000 -g 144 \
        "${model_flags[@]}" \
        -r 0 -z 1 -n 1000 -nk 2 -y 1 -pi mpi || true
    # a crash loop (an unreachable node, bad flags) would otherwise spin forever: count attempts that saved nothing
    if [ "$(latest_done)" = "$before" ] && [ ! -f "$done_file" ]; then
        failures=$((failures + 1))
        if [ "$failures" -ge "$max_failures" ]; then
            echo "run_multinode.sh: $failures attempts in a row ended without a new checkpoint; see above" >&2
            exit 1
        fi
    else
        failures=0
    fi
    sleep 1
done
echo "run_multinode.sh: finished: $done_file"
echo "plot: /usr/bin/python3 scripts/plot_log.py -o $out_dir/loss.png $out_dir"
