"""Triton / KServe v2 compatibility: protocol routes, model repository, backends, batching."""
