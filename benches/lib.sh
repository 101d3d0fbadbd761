# The preamble every device script sources (`. "$(dirname "$0")/lib.sh"`):
# strict variables, pipelines that fail when a stage fails, the repository
# root as the working folder, $OUT (the device tool's folder of files to
# bring back; a temporary folder elsewhere), NVLink multicast off (shared
# machines: see the device tool's KINDS.md), and two helpers.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT=${OUT:-$(mktemp -d)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Names the GPUs (and keeps the line in $OUT/gpu.txt).
gpu_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
}

# Stops with one line when a carried binary is missing.
need() {
  for f in "$@"; do
    [ -e "$f" ] || { echo "missing $f: build it on the development machine and carry .device/ (see the script's header)"; exit 2; }
  done
}

# Writes /tmp/TAG.toml for a timed device run: STEPS steps of the exact
# backward (mode "full") on SEQ × BATCH tokens, no evaluation during the
# run (one batch at the end), a checkpoint at the end only when CHECKPOINT
# is true; the run's files go to /tmp/run-TAG.
exact_toml() { # tag steps seq batch checkpoint(true/false)
  cat > "/tmp/$1.toml" <<T
steps = $2
[data]
seq_len = $3
batch_size = $4
[moe]
mode = "full"
[run]
eval_every = 1000
eval_batches = 1
checkpoint_every = 0
checkpoint = $5
out_dir = "/tmp/run-$1"
T
}
