# Runs inside the RDMA VM (busybox sh), in /job: the ibverbs conformance suite,
# the set-up tests and the RDMA RPC tests on each device, then the echo example
# as two processes; one RESULT line per run and a summary per device.
failed=0
summary=""

run() {
  dev="$1"; name="$2"; shift 2
  echo "== $name on $dev"
  "$@" > /tmp/out 2>&1
  rc=$?
  cat /tmp/out
  passed=$(grep -a '^test result:' /tmp/out | sed 's/.* \([0-9]*\) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
  failures=$(grep -a '^test result:' /tmp/out | sed 's/.* \([0-9]*\) failed.*/\1/' | awk '{s+=$1} END {print s+0}')
  # A test that cannot run on this device prints "skipped: <why>" (missing
  # capability) or "known deviation (...): ...; skipped".
  skipped=$(grep -a -c -E 'skipped: |; skipped$' /tmp/out)
  deviations=$(grep -a -c 'known deviation' /tmp/out)
  if [ "$rc" -ne 0 ] && [ "$failures" -eq 0 ]; then failures=1; fi
  [ "$rc" -ne 0 ] && failed=1
  line="RESULT $dev $name: $passed passed, $failures failed, $skipped skipped ($deviations known deviations checked)"
  echo "$line"
  summary="$summary
$line"
}

for dev in rxe0 siw0; do
  case "$dev" in
    rxe0) addr=10.0.0.1 ;;
    siw0) addr=10.0.1.1 ;;
  esac
  export RDMA_PROVIDER=ibverbs RDMA_DEVICE="$dev" RDMA_TEST_ADDR="$addr"
  # Memory-window support (type 2 binds a window over a registration, the
  # cheaper form of a per-frame registration): information for the log.
  echo "== memory windows on $dev"
  ibv_devinfo -v -d "$dev" 2>&1 | grep -i -E 'max_mw|MEM_WINDOW|max_mr:' || echo "(ibv_devinfo printed none)"
  # The conformance suite checks windows wherever the device binds them:
  # on rxe too, which the transport leaves without windows by default (a
  # retransmission with a bind in the send queue breaks its QP: the
  # ibverbs provider's binds_windows).
  export RDMA_MEMORY_WINDOWS=on
  run "$dev" conformance ./conformance-* --test-threads=1 --nocapture
  unset RDMA_MEMORY_WINDOWS
  run "$dev" setup ./setup-* --test-threads=1 --nocapture
  run "$dev" rpc ./rpc-* --test-threads=1 --nocapture
  run "$dev" accounting ./accounting-* --test-threads=1 --nocapture
  echo "== echo example as two processes on $dev (rdma://$addr:50051)"
  ./echo_server "rdma://$addr:50051" > /tmp/server.out 2>&1 &
  server=$!
  sleep 3
  ./echo_client "rdma://$addr:50051" 200 > /tmp/client.out 2>&1
  rc=$?
  kill -INT "$server"; wait "$server"
  cat /tmp/server.out /tmp/client.out
  if [ "$rc" -eq 0 ] && grep -q 'say("hello") -> "hello"' /tmp/client.out; then
    line="RESULT $dev echo example: 1 passed, 0 failed, 0 skipped"
  else
    line="RESULT $dev echo example: 0 passed, 1 failed, 0 skipped"; failed=1
  fi
  echo "$line"; summary="$summary
$line"
done
echo "== summary$summary"
exit $failed
