"""The v2 protocols over the core's runtimes: HTTP and gRPC front ends, wire formats, shared
memory, restricted APIs, logging and metrics (see `triton_compat`). Imports
`triton_compat.core`; the core never imports this package."""
