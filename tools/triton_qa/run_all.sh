#!/bin/bash
# Run every suite of suites.py against one server, one after the other.
#   tools/triton_qa/run_all.sh triton|continuum [run.py args...]
# Expects the v2.51.0 checkout in $TRITON_CHECKOUT (default /tmp/tsrv) and a
# main checkout in $TRITON_CHECKOUT_MAIN (default /tmp/tsrv_main) for the
# suites that exist / differ there. Extra args (e.g. --continuum-checkout DIR)
# go to every run.py call.
set -u
SERVER=$1; shift
HERE=$(dirname "$(readlink -f "$0")")
V251=${TRITON_CHECKOUT:-/tmp/tsrv}
MAIN=${TRITON_CHECKOUT_MAIN:-/tmp/tsrv_main}
SUITES=${SUITES:-"L0_http/generate_endpoint L0_backend_python/response_sender
  L0_backend_python/async_execute L0_backend_python/decoupled L0_backend_python/io
  L0_backend_python/request_rescheduling L0_backend_python/bls L0_backend_python
  L0_decoupled L0_sequence_batcher L0_http L0_grpc L0_logging L0_trace"}
# L0_batch_input needs the onnxruntime backend: Continuum only
[ "$SERVER" == "continuum" ] && SUITES="$SUITES L0_batch_input"
for suite in $SUITES; do
    python3 "$HERE/run.py" --triton-checkout "$V251" --server "$SERVER" --suite "$suite" "$@"
done
MAIN_SUITES=${MAIN_SUITES:-"L0_http/generate_endpoint L0_backend_python/parameters"}
for suite in $MAIN_SUITES; do
    python3 "$HERE/run.py" --triton-checkout "$MAIN" --tag main --server "$SERVER" --suite "$suite" "$@"
done
