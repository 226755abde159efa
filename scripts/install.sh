#!/usr/bin/env bash
# Installs Debian packages for the scripts: `scripts/install.sh PACKAGE...`. As root, or through
# sudo when it needs no password (a CI runner's user); exits 1 when neither can, or without
# apt-get. A package's own service (redis-server's Redis on 6379, which nobody would stop) is not
# started: a policy-rc.d refuses it while apt-get runs, unless the system has one already.
set -euo pipefail
[ "$#" -gt 0 ] || { echo "usage: scripts/install.sh PACKAGE..." >&2; exit 2; }
as_root=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    exit 1
  fi
fi
command -v apt-get >/dev/null 2>&1 || exit 1
echo "installing $* (Debian packages)" >&2
policy=/usr/sbin/policy-rc.d
placed=""
remove_policy() { if [ -n "$placed" ]; then "${as_root[@]}" rm -f "$policy"; fi; }
trap remove_policy EXIT
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
  placed=1
  "${as_root[@]}" chmod 755 "$policy"
fi
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
