#!/usr/bin/env bash
# A fake multi-host cluster on one Linux machine, for dstool's multi-node tests (tests/netns.py drives it).
#
#   netns-cluster.sh up [N]          N "hosts" node0..node{N-1} (default 2), each a network namespace with its own
#                                    IP $NET.(i+1) on eth0, its own hostname, /etc/hosts and an sshd on port 22
#   netns-cluster.sh on HOST CMD...  run CMD "on" HOST (its netns, hostname, /etc/hosts, /etc/ssh)
#   netns-cluster.sh fault HOST down|up|slow|fast|drop|undrop   a network fault on HOST's link
#   netns-cluster.sh sshd HOST stop|start [SSHD-ARGS...]        stop HOST's sshd, or start it (e.g. -o SetEnv=X=1)
#   netns-cluster.sh loopback HOST on|off   HOST's own name resolves to 127.0.1.1 there (Debian's default) or not
#   netns-cluster.sh status | down
#
# Environment: NETNS_CLUSTER_DIR (state folder, default $TMPDIR/netns-cluster), NETNS_CLUSTER_PREFIX (namespace
# names, default dsc: dsc-sw, dsc-node0, ...), NETNS_CLUSTER_NET (first three octets, default 10.200.0).
#
# Nothing is written outside $BASE but the namespaces themselves: the root network namespace gets no interface
# and no route (the hosts are joined by a bridge in a private "switch" namespace), and /etc/hosts, /etc/ssh, /run
# are replaced only inside each host's private mount namespace (bind mounts), never on the machine.
# Needs: root, iproute2, util-linux (unshare), openssh-server + openssh-client; pdsh for the DeepSpeed launcher;
# iptables only for `fault drop` (scripts/setup.sh installs them on Debian).
set -euo pipefail

BASE=${NETNS_CLUSTER_DIR:-${TMPDIR:-/tmp}/netns-cluster}
NS=${NETNS_CLUSTER_PREFIX:-dsc}
NET=${NETNS_CLUSTER_NET:-10.200.0}
SELF=$(readlink -f "$0")
PATH=$PATH:/usr/sbin:/sbin

ip_of() { echo "$NET.$(( ${1#node} + 1 ))"; }
hosts_up() { cat "$BASE/nodes" 2>/dev/null || true; }
our_namespaces() { ip netns list | awk '{print $1}' | grep "^$NS-" || true; }

# Enter HOST: its netns (ip netns exec also remounts /sys), then a private mount + UTS namespace in which
# /etc/hosts, /etc/ssh and /run are this cluster's, and the hostname is HOST.
on() {
  local h=$1; shift
  exec ip netns exec "$NS-$h" unshare --mount --uts --propagation private -- /bin/bash -c '
    set -e
    mount --bind "$0/$1/hosts" /etc/hosts
    mount --bind "$0/etc-ssh" /etc/ssh
    mount -t tmpfs -o mode=0755 tmpfs /run && mkdir -m 0755 /run/sshd
    hostname "$1"
    shift 2
    exec "$@"' "$BASE" "$h" _ "$@"
}

# HOST's /etc/hosts, rewritten in place (the bind mount follows the inode): every host by name, and with the
# loopback line Debian writes ("127.0.1.1 <own name>", which makes gloo advertise a loopback address).
write_hosts() {
  local h=$1 loopback=$2
  { [[ $loopback = on ]] && echo "127.0.1.1 $h"; cat "$BASE/hosts"; } > "$BASE/$h/hosts.new"
  cat "$BASE/$h/hosts.new" > "$BASE/$h/hosts"
  rm "$BASE/$h/hosts.new"
}

start_sshd() {
  local h=$1; shift
  "$SELF" on "$h" /usr/sbin/sshd -f /etc/ssh/sshd_config -o PidFile="$BASE/$h/sshd.pid" -E "$BASE/$h/sshd.log" "$@"
  # sshd's daemon child writes the pid file after its parent has returned: wait for it, so stop and
  # Cluster.processes() never read an empty one
  local i
  for i in $(seq 100); do [[ -s $BASE/$h/sshd.pid ]] && return 0; sleep 0.1; done
  echo "sshd on $h wrote no pid file in 10 s: $(tail -3 "$BASE/$h/sshd.log")" >&2; return 1
}

stop_sshd() {
  local pid
  pid=$(cat "$BASE/$1/sshd.pid" 2>/dev/null || true)
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then kill "$pid"; fi
  rm -f "$BASE/$1/sshd.pid"
}

up() {
  local n=${1:-2} t0=$SECONDS h i
  [[ -e $BASE/nodes ]] && { echo "already up ($(hosts_up | xargs)); run '$0 down' first" >&2; exit 1; }
  mkdir -p "$BASE/etc-ssh" "$BASE/ssh"
  # one client key for root on every host; host key; ssh/sshd config seen as /etc/ssh on every host
  [[ -f $BASE/ssh/id_ed25519 ]] || ssh-keygen -q -t ed25519 -N '' -C dstool-netns -f "$BASE/ssh/id_ed25519"
  cp "$BASE/ssh/id_ed25519.pub" "$BASE/ssh/authorized_keys"
  [[ -f $BASE/etc-ssh/ssh_host_ed25519_key ]] || ssh-keygen -q -t ed25519 -N '' -f "$BASE/etc-ssh/ssh_host_ed25519_key"
  cp /etc/ssh/moduli "$BASE/etc-ssh/" 2>/dev/null || true
  cat > "$BASE/etc-ssh/ssh_config" <<EOF
Host *
  IdentityFile $BASE/ssh/id_ed25519
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
  ConnectTimeout 5
EOF
  cat > "$BASE/etc-ssh/sshd_config" <<EOF
Port 22
HostKey $BASE/etc-ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile $BASE/ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 100
PrintMotd no
Subsystem sftp /usr/lib/openssh/sftp-server
EOF
  { echo "127.0.0.1 localhost"; for ((i = 0; i < n; i++)); do echo "$(ip_of node$i) node$i"; done; } > "$BASE/hosts"
  : > "$BASE/hostfile"

  ip netns add "$NS-sw"
  ip -n "$NS-sw" link set lo up
  ip -n "$NS-sw" link add br0 type bridge
  ip -n "$NS-sw" link set br0 up
  for ((i = 0; i < n; i++)); do
    h=node$i
    mkdir -p "$BASE/$h"
    write_hosts "$h" off
    ip netns add "$NS-$h"
    ip -n "$NS-sw" link add "$h" type veth peer name eth0 netns "$NS-$h"
    ip -n "$NS-sw" link set "$h" master br0 up
    ip -n "$NS-$h" link set lo up
    ip -n "$NS-$h" addr add "$(ip_of $h)/24" dev eth0
    ip -n "$NS-$h" link set eth0 up
    start_sshd "$h"
    echo "$h slots=1" >> "$BASE/hostfile"
    echo "$h" >> "$BASE/nodes"
  done
  # wait until every host can ssh to every host (bridge ports go forwarding, sshd listens)
  for h in $(hosts_up); do for t in $(hosts_up); do
    for _ in $(seq 50); do "$SELF" on "$h" ssh "$t" true 2>/dev/null && break; sleep 0.2; done
    "$SELF" on "$h" ssh "$t" true || { echo "ssh $h -> $t failed" >&2; exit 1; }
  done; done
  echo "up: $(hosts_up | xargs) in $((SECONDS - t0)) s; hostfile $BASE/hostfile; '$0 on node0 CMD'"
}

down() {  # also after a partial `up`: every namespace with our prefix goes
  local h ns pid
  for h in $(hosts_up); do stop_sshd "$h"; done
  # any process left inside our namespaces (e.g. a rank that outlived its ssh session), by PID
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
  done
  sleep 0.5
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true   # deleting a namespace also deletes its veth ends
  done
  rm -f "$BASE/nodes"
  echo "down"
}

fault() {  # HOST down|up|slow|fast|drop|undrop
  local h=$1 what=$2
  case $what in
    down) ip -n "$NS-sw" link set "$h" down ;;             # cable pulled: packets vanish, no RST
    up) ip -n "$NS-sw" link set "$h" up ;;
    # rate limit both directions (this kernel has no netem, so no delay/loss emulation; tbf works)
    slow) ip netns exec "$NS-$h" tc qdisc replace dev eth0 root tbf rate 1mbit burst 32kbit latency 400ms
          ip netns exec "$NS-sw" tc qdisc replace dev "$h" root tbf rate 1mbit burst 32kbit latency 400ms ;;
    fast) ip netns exec "$NS-$h" tc qdisc del dev eth0 root 2>/dev/null || true
          ip netns exec "$NS-sw" tc qdisc del dev "$h" root 2>/dev/null || true ;;
    # firewall: HOST silently drops everything on its cluster link (like a partition; link stays up)
    drop) ip netns exec "$NS-$h" iptables -A INPUT -i eth0 -j DROP
          ip netns exec "$NS-$h" iptables -A OUTPUT -o eth0 -j DROP ;;
    undrop) ip netns exec "$NS-$h" iptables -D INPUT -i eth0 -j DROP
            ip netns exec "$NS-$h" iptables -D OUTPUT -o eth0 -j DROP ;;
    *) echo "fault HOST down|up|slow|fast|drop|undrop" >&2; exit 2 ;;
  esac
}

sshd_cmd() {  # HOST stop|start [SSHD-ARGS...]
  local h=$1 what=$2; shift 2
  case $what in
    stop) stop_sshd "$h" ;;
    start) stop_sshd "$h"; start_sshd "$h" "$@" ;;
    *) echo "sshd HOST stop|start [SSHD-ARGS...]" >&2; exit 2 ;;
  esac
}

status() {
  our_namespaces
  for h in $(hosts_up); do
    echo "$h $(ip_of $h) sshd pid $(cat "$BASE/$h/sshd.pid" 2>/dev/null) procs: $(ip netns pids "$NS-$h" | xargs)"
  done
}

cmd=${1:-}; shift || true
case $cmd in
  up) up "$@" ;;
  down) down ;;
  on) on "$@" ;;
  fault) fault "$@" ;;
  sshd) sshd_cmd "$@" ;;
  loopback) write_hosts "$1" "$2" ;;
  status) status ;;
  *) sed -n '2,12p' "$SELF"; exit 2 ;;
esac
