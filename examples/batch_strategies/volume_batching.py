"""Volume batching: a custom batching rule that caps the bytes of input in one batch.

The python form of Triton's volume-batching example (triton-inference-server/backend,
examples/batch_strategy/volume_batching): a request joins the batch only while the batch's
total input size stays within the model config parameter `MAX_BATCH_VOLUME_BYTES`. Use it as
`batch_strategy.py` in a model's folder (or its version folder), or name it with the
`TRITON_BATCH_STRATEGY_PATH` parameter; the model needs `dynamic_batching`.
"""


def batcher_initialize(model_config):
    """The batcher's state: the volume cap in bytes. Raises KeyError / ValueError when the
    parameter is missing or not an integer (the model then fails to load)."""
    return int(model_config["parameters"]["MAX_BATCH_VOLUME_BYTES"]["string_value"])


def batch_initialize(max_bytes):
    """A new batch: [bytes left]."""
    return [max_bytes]


def batch_include_request(request, left):
    """Include `request` while its input bytes fit in what the batch has left."""
    size = sum(t.as_numpy().nbytes for t in request.inputs())
    if size > left[0]:
        return False
    left[0] -= size
    return True


def batch_finalize(left):
    """Nothing to free."""


def batcher_finalize(max_bytes):
    """Nothing to free."""
