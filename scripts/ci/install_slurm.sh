#!/usr/bin/env bash
# Installs a one-node Slurm (Debian's slurm-wlm + munge) for tests/slurm, which start the daemons
# themselves. Without root or apt-get it says so and exits 0: those tests then skip with the reason.
set -uo pipefail
if command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_slurm: needs root and apt-get; tests/slurm will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
packages=(slurm-wlm munge)
apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; } \
    || echo "install_slurm: apt-get install ${packages[*]} failed; tests/slurm will skip" >&2
exit 0
