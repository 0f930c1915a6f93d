"""Triton's `inference.GRPCInferenceService` (KServe v2 over gRPC) on `--grpc-port`.

`codec` translates messages, `service` answers the RPCs over the same repository, runtimes and
shared-memory regions as the HTTP routes, `server` runs it on the HTTP server's event loop.
"""
