"""Triton / KServe v2 compatibility, in two layers as Triton's own server and core:

- `triton_compat.frontend` — the protocols: HTTP routes (`routes`, the `http_infer` fast path,
  `generate`, `shm_routes`), the gRPC service (`grpc/`), the wire formats (`tensors`,
  `classification`), one inference whatever the wire (`infer`), shared-memory regions,
  restricted APIs, the logging extension and the `nv_inference_*` metrics exposition.
- `triton_compat.core` — the models: the repository and its control modes, configuration
  (`config`, `config_loader`, `auto_complete`), the `Runtime` interface (`runtime_api`) and its
  implementations (`runtime` with the dynamic batcher, `sequence/`, `ensemble`, `llm_model`),
  request checks (`validate`), backends (`backends/`), the python backend's API (`pb_utils`,
  `bls`) and statistics.

The front end imports the core, never the other way (tests/test_imports.py). Shared by both:
`errors` (the one error type) and `trace/` (the trace extension).
"""
