# Runs in both guests of `scripts/rdma-vm/run --pair` (busybox sh, in /job):
# the two-host suite. The server guest serves examples/cross_host and the echo
# example on rxe0 (10.0.2.1) and siw0 (10.0.3.1) and takes control messages
# on eth2 (set netem on its side, die); the client guest checks every call
# kind across each link, runs the echo example's client, then keeps calls in
# flight while it breaks the link (docs/providers.md, "Two hosts"). One
# RESULT line per run, one FAULT line per row of the fault table.
export RDMA_PROVIDER=ibverbs
# The QPs' ACK timeout (ConnectOptions::ack_timeout): the default, 67 ms, is
# a datacenter fabric's; these links are emulated (one vCPU per guest, and
# netem adds 40 ms of round trip), where a 256 KiB READ's response takes
# longer than 67 ms to arrive and is asked for again and again. 4.096 us x
# 2^17 = 537 ms, retried for 4.3 s in all; cut links and dead hosts are
# noticed sooner, by the rows' keepalive.
export RDMA_ACK_TIMEOUT_MS=500

serve() {
  cat > /tmp/control.sh <<'EOF'
#!/bin/sh
# One command per connection, from the client guest's job over eth2.
read -r command rest
case "$command" in
  ready) if [ -f /tmp/ready ]; then echo ready; else echo waiting; fi ;;
  tc) if /usr/bin/tc $rest > /tmp/tc.out 2>&1; then echo ok; else echo "tc $rest: $(cat /tmp/tc.out)"; fi ;;
  # rxe0's retry counters on this side (printed by the client after each row).
  counters) /tmp/retries ;;
  # rxe0's QPs (state, the PSN its requester sends next, the PSN its
  # responder expects next) and every counter that is not 0.
  qps) /tmp/qps ;;
  # The host dies at once: no FIN, no disconnect, no flush reaches the peer.
  # (Its output away from the connection, which must close for the asker.)
  die) echo ok; (sleep 0.2; echo o > /proc/sysrq-trigger) < /dev/null > /dev/null 2>&1 & ;;
  *) echo "unknown command: $command" ;;
esac
EOF
  chmod +x /tmp/control.sh
  rxe_scripts
  nc -ll -p 7000 -e /tmp/control.sh &
  for dev in rxe0 siw0; do
    case "$dev" in rxe0) addr=10.0.2.1 ;; siw0) addr=10.0.3.1 ;; esac
    RDMA_DEVICE=$dev ./cross_host serve "rdma://$addr:50051" > "/tmp/cross-$dev.out" 2>&1 &
    RDMA_DEVICE=$dev ./echo_server "rdma://$addr:50052" > "/tmp/echo-$dev.out" 2>&1 &
  done
  for _ in $(seq 600); do
    up=$(cat /tmp/cross-*.out /tmp/echo-*.out 2>/dev/null | grep -c 'listening on')
    [ "$up" -ge 4 ] && break
    sleep 0.5
  done
  cat /tmp/cross-*.out /tmp/echo-*.out
  if [ "$up" -ge 4 ]; then touch /tmp/ready; echo "server: ready"; else echo "server: NOT ready"; fi
  # Until the client's job tells this host to die (or the pair's timeout).
  while true; do sleep 60; done
}

# Two views of rxe0, used on both guests. /tmp/retries: its retry counters,
# on one line. /tmp/qps: its queue pairs and its counters that are not 0,
# on one line each: what a connection that fell silent was waiting for
# (sq-psn is the next PSN its requester sends, rq-psn the next its
# responder expects).
rxe_scripts() {
  cat > /tmp/retries <<'EOF'
#!/bin/sh
cd /sys/class/infiniband/rxe0/ports/1/hw_counters && for f in completer_retry_err duplicate_request retry_exceeded_err rcvd_seq_err out_of_seq_request; do
  printf '%s %s, ' "$f" "$(cat $f)"
done
echo
EOF
  cat > /tmp/qps <<'EOF'
#!/bin/sh
/usr/bin/rdma res show qp link rxe0/1 2>&1 | grep -v 'type GSI' | tr -s ' '
cd /sys/class/infiniband/rxe0/ports/1/hw_counters && for f in *; do
  v=$(cat "$f"); [ "$v" = 0 ] || printf '%s %s, ' "$f" "$v"
done
echo
EOF
  chmod +x /tmp/retries /tmp/qps
}

ctl_script() {
  cat > /tmp/ctl <<'EOF'
#!/bin/sh
# ctl COMMAND...: sends COMMAND to the server guest; fails unless it says ok.
answer=$(echo "$*" | nc 10.0.9.1 7000)
[ "$answer" = ok ] || { echo "server guest: $answer" >&2; exit 1; }
EOF
  chmod +x /tmp/ctl
}

failed=0
summary=""
table=""

# run DEV NAME COMMAND...: a run that ends with cargo's "test result:" lines.
run() {
  dev="$1"; name="$2"; shift 2
  echo "== $name on $dev"
  { "$@"; echo $? > /tmp/rc; } 2>&1 | tee /tmp/out
  rc=$(cat /tmp/rc)
  passed=$(grep -a '^test result:' /tmp/out | sed 's/.* \([0-9]*\) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
  failures=$(grep -a '^test result:' /tmp/out | sed 's/.* \([0-9]*\) failed.*/\1/' | awk '{s+=$1} END {print s+0}')
  if [ "$rc" -ne 0 ] && [ "$failures" -eq 0 ]; then failures=1; fi
  [ "$rc" -ne 0 ] && failed=1
  note "RESULT $dev $name: $passed passed, $failures failed, 0 skipped"
}

note() {
  echo "$1"
  summary="$summary
$1"
}

# row DEV LABEL LOAD-ARGS...: one row of the fault table.
row() {
  dev="$1"; label="$2"; shift 2
  echo "== fault table: $label on $dev"
  : > "/tmp/row-$dev"
  [ "$dev" = rxe0 ] && { watch_silence "/tmp/row-$dev" & watcher=$!; }
  { ./cross_host load "$endpoint" --label "$dev, $label" "$@"; echo $? > /tmp/rc; } 2>&1 | tee "/tmp/row-$dev"
  [ "$dev" = rxe0 ] && kill "$watcher" 2>/dev/null
  rc=$(cat /tmp/rc)
  table="$table
$(grep -a '^FAULT' "/tmp/row-$dev")"
  if [ "$dev" = rxe0 ]; then
    echo "rxe0 counters, client: $(/tmp/retries)"
    echo "rxe0 counters, server: $(echo counters | nc 10.0.9.1 7000)"
  fi
  if [ "$rc" -eq 0 ]; then
    note "RESULT $dev faults, $label: 1 passed, 0 failed, 0 skipped"
  else
    failed=1; note "RESULT $dev faults, $label: 0 passed, 1 failed, 0 skipped"
  fi
}

# watch_silence FILE: once the row in FILE says its calls fell silent, both
# sides' rxe0 queue pairs and counters, while the silence lasts.
watch_silence() {
  while sleep 0.5; do
    if [ "$(grep -a -c '^silent:' "$1")" -gt 0 ]; then
      echo "silent: rxe0 here (client): $(/tmp/qps | tr '\n' ';')"
      echo "silent: rxe0 there (server): $(echo qps | nc 10.0.9.1 7000 | tr '\n' ';')"
      return
    fi
  done
}

# netem ARGS: the same netem on both ends of this device's link.
netem() { echo "/usr/bin/tc qdisc add dev $netdev root netem $* && /tmp/ctl tc qdisc add dev $netdev root netem $*"; }
unnetem() { echo "/usr/bin/tc qdisc del dev $netdev root; /tmp/ctl tc qdisc del dev $netdev root"; }

check() {
  ctl_script
  rxe_scripts
  echo "== waiting for the server guest"
  for _ in $(seq 360); do
    [ "$(echo ready | nc 10.0.9.1 7000 2>/dev/null)" = ready ] && break
    sleep 0.5
  done
  [ "$(echo ready | nc 10.0.9.1 7000 2>/dev/null)" = ready ] || { echo "the server guest never got ready"; exit 1; }
  for dev in rxe0 siw0; do
    case "$dev" in
      # How long a cut link or a dead host takes to notice: the rows'
      # keepalive, a probe after 0.5 s of silence and 0.5 s for its answer
      # (rxe's RC retry budget, 4.3 s here, is longer; siw, iWARP, leaves
      # retransmission to TCP and has none).
      rxe0) addr=10.0.2.1; netdev=eth0; budget_ms=1000 ;;
      siw0) addr=10.0.3.1; netdev=eth1; budget_ms=1000 ;;
    esac
    export RDMA_DEVICE=$dev
    endpoint="rdma://$addr:50051"
    echo "== $dev: $(ibv_devinfo -d $dev | grep -E 'active_mtu|link_layer|transport' | tr -s ' \t' ' ' | tr '\n' ';')"
    run "$dev" "two hosts: suite" ./cross_host check "$endpoint"
    echo "== echo example across the link on $dev (rdma://$addr:50052)"
    if ./echo_client "rdma://$addr:50052" 200 > /tmp/client.out 2>&1 && grep -q 'say("hello") -> "hello"' /tmp/client.out; then
      cat /tmp/client.out; note "RESULT $dev two hosts: echo example: 1 passed, 0 failed, 0 skipped"
    else
      cat /tmp/client.out; failed=1; note "RESULT $dev two hosts: echo example: 0 passed, 1 failed, 0 skipped"
    fi
    # Every row: 4 small calls, one 256 KiB echo (RDMA READ both ways) and
    # one bidirectional stream in flight (one vCPU per guest under TCG).
    # Loss and delay cover the whole run; every call must complete, with the
    # channel's default keepalive, within 60 s (p99 under 10% loss is ~10 s).
    load="--small 4 --large 1 --large-kib 256"
    whole="$load --seconds 10 --fault-at 0.2 --fault-for 9.6 --expect complete --deadline-s 60"
    row "$dev" "no fault" $load --seconds 10 --expect complete
    row "$dev" "loss 1%" $whole --fault "$(netem loss 1%)" --restore "$(unnetem)"
    row "$dev" "loss 10%" $whole --fault "$(netem loss 10%)" --restore "$(unnetem)"
    row "$dev" "delay 1 ms" $whole --fault "$(netem delay 1ms limit 100000)" --restore "$(unnetem)"
    row "$dev" "delay 20 ms" $whole --fault "$(netem delay 20ms limit 100000)" --restore "$(unnetem)"
    row "$dev" "link down 2 s" $load --seconds 12 --fault-at 3 --fault-for 2 --expect unavailable \
      --keepalive-ms 500 --budget-ms "$budget_ms" --fault "ip link set $netdev down" --restore "ip link set $netdev up"
  done
  # The server's host dies with calls in flight on both links: the rxe0 run
  # kills it, the siw0 run marks the same moment.
  echo "== fault table: server host killed (both links at once)"
  dead="--small 4 --large 1 --large-kib 256 --seconds 8 --fault-at 3 --expect dead --keepalive-ms 500"
  RDMA_DEVICE=rxe0 ./cross_host load rdma://10.0.2.1:50051 --label "rxe0, server host killed" \
    $dead --budget-ms 1000 --fault "/tmp/ctl die" > /tmp/kill-rxe0 2>&1 &
  rxe_run=$!
  RDMA_DEVICE=siw0 ./cross_host load rdma://10.0.3.1:50051 --label "siw0, server host killed" \
    $dead --budget-ms 1000 --fault "true" > /tmp/kill-siw0 2>&1
  siw_rc=$?
  wait "$rxe_run"
  rxe_rc=$?
  for dev in rxe0 siw0; do
    cat "/tmp/kill-$dev"
    table="$table
$(grep -a '^FAULT' "/tmp/kill-$dev")"
  done
  for pair in "rxe0 $rxe_rc" "siw0 $siw_rc"; do
    set -- $pair
    if [ "$2" -eq 0 ]; then
      note "RESULT $1 faults, server host killed: 1 passed, 0 failed, 0 skipped"
    else
      failed=1; note "RESULT $1 faults, server host killed: 0 passed, 1 failed, 0 skipped"
    fi
  done
  echo "== fault table (columns: device and fault | answered | errors by code | small calls/s | small-call latency | first error after the fault | first success after the restore | leaks | verdict)$table"
  echo "== summary$summary"
  exit $failed
}

case "$RDMA_VM_HOST" in
  server) serve ;;
  client) check ;;
  *) echo "pair-guest.sh runs in a pair (RDMA_VM_HOST=server|client), not in '$RDMA_VM_HOST'"; exit 1 ;;
esac
