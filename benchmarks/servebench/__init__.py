"""The benchmark library `continuum` ships: `continuum bench serve` and `continuum bench compare`.

Owns: the load generator (`serve_bench`: datasets in, streamed requests out, vLLM's metrics
back), its datasets (`bench_datasets`), its metrics (`bench_metrics`), the comparison of
Continuum with other servers on one workload (`compare`) and the transformers static-batching
BASELINE server it compares against (`hf_baseline_server`). `api/cli.py` imports it; the
benchmark scripts beside this package (`benchmarks/*.py`) are not part of the CLI.
"""
