#!/usr/bin/env bash
# A one-node SLURM on this machine for tests/test_clusters.py (.ci/run starts it): munged, slurmctld and slurmd
# as root, their configuration, state and logs in DIR (default: a new temporary folder). Prints the path of its
# slurm.conf: export SLURM_CONF=that path for sbatch, squeue and submitit to use it.
# Needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge). Stop it with: pkill -F DIR/slurmctld.pid
# and pkill -F DIR/slurmd.pid.
set -euo pipefail
dir=$(realpath -m "${1:-$(mktemp -d)}")
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
host=$(hostname -s)
cat > "$dir/slurm.conf" <<EOF
ClusterName=fedmerge-ci
SlurmctldHost=$host
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=10
NodeName=$host CPUs=$(nproc) RealMemory=$(($(free -m | awk '/^Mem:/ {print $2}') / 2)) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
# munged: no systemd in a CI container; its key comes with the package
if ! munge -n >/dev/null 2>&1; then
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  /usr/sbin/munged --force
fi
export SLURM_CONF=$dir/slurm.conf
slurmctld -i
slurmd
for _ in $(seq 60); do
  if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
    echo "$SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "slurm_one_node: the node did not come up; see $dir/log" >&2
exit 1
