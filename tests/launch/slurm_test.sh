#!/usr/bin/env bash
# Bulkhead under a real Slurm: a one-node cluster from the distribution's
# packages (slurm-wlm, munge), started here with a minimal configuration.
#
#   1. srun -n 4 bulkhead-collectives with PMIx (MPI starts the world) and
#      without (--mpi=none: the store bootstrap and the gloo backend).
#   2. sbatch launch/slurm/train_moe.sbatch with a one-minute limit and
#      --signal=TERM@45: SIGTERM arrives mid-run, the job saves and exits 0;
#      requeued, it resumes from that step.
#
# Runs as root on Debian or Ubuntu (installs the packages when missing);
# elsewhere it says why and exits 77 (skipped).
# usage: slurm_test.sh <source dir> <bin dir>
set -u
src=$1 bin=$2
skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "the Slurm test runs as root (it starts slurmctld, slurmd and munged)"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || skip "no slurmctld/munged and no apt-get to install slurm-wlm and munge"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 ||
    skip "slurm-wlm and munge could not be installed (apt-get install failed)"
fi

dir=$(mktemp -d /tmp/bulkhead-slurm.XXXXXX)
conf=$dir/slurm.conf
export SLURM_CONF=$conf
cleanup() {
  scancel --quiet --full "${job:-0}" 2>/dev/null
  [ -f "$dir/slurmd.pid" ] && kill "$(cat "$dir/slurmd.pid")" 2>/dev/null
  [ -f "$dir/slurmctld.pid" ] && kill "$(cat "$dir/slurmctld.pid")" 2>/dev/null
  sleep 1
  [ -n "${KEEP:-}" ] || rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -30 "$f"; }; done
  exit 1
}

# munge: the authentication Slurm's daemons and commands share.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 2>/dev/null; }
  chown -R munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
  chmod 600 /etc/munge/munge.key
  runuser -u munge -- munged || fail "munged did not start"
  sleep 1
  munge -n | unmunge >/dev/null || fail "munge does not work"
fi

host=$(hostname -s)
ctl_port=$((20000 + RANDOM % 12000)) # and the next two: below the ephemeral range (32768 up)
mkdir -p "$dir/state" "$dir/spool"
cat >"$conf" <<EOF
ClusterName=bulkhead-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctl_port
SlurmdPort=$((ctl_port + 1))
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=10
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host CPUs=8 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -f "$conf" || fail "slurmctld did not start"
slurmd -f "$conf" || fail "slurmd did not start"
for _ in $(seq 60); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  sleep 1
done
sinfo -h -o %t | grep -q idle || fail "the node did not come up: $(sinfo 2>&1)"
echo "Slurm $(sinfo -V) is up on $host"

# 1. srun with PMIx, and without.
if srun --mpi=list 2>&1 | grep -q pmix; then
  timeout 120 srun --mpi=pmix -n 4 "$bin/bulkhead-collectives" --iters 1 --sizes 4K >"$dir/srun_pmix.log" 2>&1 ||
    fail "srun --mpi=pmix -n 4 bulkhead-collectives failed"
  grep -q "4 ranks, backend mpi" "$dir/srun_pmix.log" || fail "srun with PMIx did not run 4 ranks on mpi"
  grep -q "all results correct" "$dir/srun_pmix.log" || fail "srun with PMIx: wrong results"
  echo "srun --mpi=pmix -n 4: 4 ranks on the mpi backend, all results correct"
else
  echo "srun has no PMIx plugin here: the PMIx run is left out"
fi
MASTER_ADDR=127.0.0.1 MASTER_PORT=$((ctl_port + 2)) BULKHEAD_STORE_TOKEN=slurm-test \
  timeout 120 srun --mpi=none -n 4 "$bin/bulkhead-collectives" --iters 1 --sizes 4K >"$dir/srun_none.log" 2>&1 ||
  fail "srun --mpi=none -n 4 bulkhead-collectives failed"
grep -q "4 ranks, backend gloo" "$dir/srun_none.log" || fail "srun without PMIx did not run 4 ranks on gloo"
grep -q "all results correct" "$dir/srun_none.log" || fail "srun without PMIx: wrong results"
echo "srun --mpi=none -n 4: 4 ranks on the gloo backend (store bootstrap), all results correct"

# 2. The batch script: SIGTERM before the limit, save, exit 0; requeue, resume.
ckpt=$dir/ckpt
export BULKHEAD_HOME=$src BULKHEAD_BIN=$bin BULKHEAD_SRUN_MPI=none
export BULKHEAD_TRAIN_FLAGS="--backend gloo --dtype float32 --steps 100000 --log-interval 50 --ckpt-interval 0"
job=$(sbatch --parsable --ntasks=2 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 --time=1 \
  --signal=TERM@45 --open-mode=append --output="$dir/job.log" --requeue \
  "$src/launch/slurm/train_moe.sbatch" "$ckpt") || fail "sbatch refused the job"
echo "submitted job $job"
wait_done() {
  for _ in $(seq 150); do
    state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
    case $state in COMPLETED | FAILED | TIMEOUT | CANCELLED* | NODE_FAIL | OUT_OF_MEMORY) return 0 ;; esac
    sleep 1
  done
  return 1
}
job_state() { scontrol show job "$job" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
job_exit() { scontrol show job "$job" | grep -o ' ExitCode=[0-9:]*' | cut -d= -f2; }
wait_done || fail "job $job did not end within 150 s"
[ "$(job_state)" = COMPLETED ] || fail "job $job ended $(job_state) (exit $(job_exit)), not COMPLETED"
saved=$(grep -o 'saving step [0-9]*' "$dir/job.log" | tail -1 | awk '{print $3}')
[ -n "$saved" ] || fail "the job did not save on SIGTERM"
[ "$saved" -gt 1 ] || fail "SIGTERM arrived before training ran (saved step $saved)"
[ -e "$ckpt/latest" ] || fail "no committed checkpoint after the job"
echo "job $job: SIGTERM mid-run, saved step $saved, exit $(job_exit)"

scontrol requeue "$job" || fail "scontrol requeue $job failed"
# A requeued job waits before it may start again; this one may start now.
sleep 1
scontrol update JobId="$job" StartTime=now >/dev/null 2>&1
wait_done || fail "the requeued job did not end within 150 s"
[ "$(job_state)" = COMPLETED ] || fail "the requeued job ended $(job_state), not COMPLETED"
grep -q "resumed from .*(step $saved," "$dir/job.log" || fail "the requeued job did not resume from step $saved"
saved2=$(grep -o 'saving step [0-9]*' "$dir/job.log" | tail -1 | awk '{print $3}')
[ "$saved2" -gt "$saved" ] || fail "the requeued job did not train past step $saved"
echo "requeued: resumed from step $saved, saved step $saved2 on the next SIGTERM"
echo PASS
