#!/usr/bin/env bash
# What a short CFS period costs the node: N busybox containers spin at CPUS each under a
# 100 ms and a 10 ms period in turn (ROUNDS rounds, SECS seconds each), and the host's
# kernel time (system + irq + softirq, from /proc/stat) and the containers' own CPU time
# are compared. The rest of the machine runs on, so compare the periods within a round.
#   loadtest/scripts/cfs-period-cost.sh [N=8] [CPUS=0.2] [SECS=8] [ROUNDS=3]
# PERIODS (µs, default "100000 10000") chooses the periods compared.
set -euo pipefail
N=${1:-8} CPUS=${2:-0.2} SECS=${3:-8} ROUNDS=${4:-3}
IMAGE=${IMAGE:-sandpool/busybox:latest}
PERIODS=${PERIODS:-100000 10000}
label="sandpool-cfs-period-$$"
trap 'docker rm -f $(docker ps -aq --filter label=$label) >/dev/null 2>&1 || true' EXIT
kernel_ticks() { awk '/^cpu /{print $4+$7+$8}' /proc/stat; }
hz=$(getconf CLK_TCK)
for round in $(seq "$ROUNDS"); do
  for period_us in $PERIODS; do
    quota_us=$(awk -v c="$CPUS" -v p="$period_us" 'BEGIN{printf "%d", c*p}')
    ids=()
    for i in $(seq "$N"); do
      ids+=("$(docker run -d --rm --label "$label" --network none --cpu-period "$period_us" --cpu-quota "$quota_us" \
        "$IMAGE" sh -c 'while :; do :; done')")
    done
    sleep 1
    used() { local t=0; for id in "${ids[@]}"; do
      pid=$(docker inspect -f '{{.State.Pid}}' "$id"); path=$(awk -F: '/cpuacct/{print $3}' /proc/$pid/cgroup)
      t=$((t + $(cat /sys/fs/cgroup/cpuacct$path/cpuacct.usage))); done; echo $t; }
    u0=$(used); k0=$(kernel_ticks)
    sleep "$SECS"
    u1=$(used); k1=$(kernel_ticks)
    throttled=0
    for id in "${ids[@]}"; do
      pid=$(docker inspect -f '{{.State.Pid}}' "$id"); path=$(awk -F: '/cpuacct/{print $3}' /proc/$pid/cgroup)
      throttled=$((throttled + $(awk '/^nr_throttled/{print $2}' /sys/fs/cgroup/cpu$path/cpu.stat)))
    done
    awk -v r="$round" -v p="$period_us" -v u=$((u1 - u0)) -v k=$((k1 - k0)) -v hz="$hz" -v s="$SECS" -v n="$N" -v th="$throttled" \
      'BEGIN{printf "round %d period %3d ms: containers %.3f CPU, host kernel time %.3f CPU, throttled periods %d\n", r, p/1000, u/1e9/s, k/hz/s, th}'
    docker rm -f "${ids[@]}" >/dev/null
  done
done
