"""The v2 layer's models: repository, configuration, runtimes and batchers, backends and the
python backend's API (see `triton_compat`). Flows in: a request's validated tensors from a
front end (`triton_compat.frontend`), which this package never imports; flows out: outputs or
an `InferError`."""
