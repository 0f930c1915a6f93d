"""Triton's classification extension: an output asked for with `classification: k` comes back
as its top-k classes, BYTES strings "<value>:<index>[:<label>]", instead of its tensor.

Owns: the top-k rule, the value text and the batch split; the output's labels (one per line in
the file its config's `label_filename` names) are read when the model loads
(`core.config_loader.load_labels`).
In: the output's array and wire datatype, k, whether the model batches (`max_batch_size` > 0:
the first dimension is the batch, k classes per batch entry), the labels. Out: a numpy object
array of bytes, shape [batch, min(k, classes)] or [min(k, classes)].
Reference: Triton's protocol/extension_classification.md; tritonserver 2.51's
`src/classification.cc` (values as C++'s `std::to_string`: integers as they are, floats with
six decimals) and `src/http_server.cc` (the batch split, the shape).
"""

from __future__ import annotations

import numpy as np

from triton_compat.errors import InferError

# The datatypes tritonserver 2.51 classifies (others: its INVALID_ARG text, see `classify`).
_CLASSIFIABLE = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                 "FP32", "FP64"}


def class_count(value, where: str = "classification") -> int:
    """An output's `classification` parameter as a count (0: no classification).
    Raises InferError(400) for anything but a non-negative integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InferError(f"Unable to parse '{where}': attempt to access JSON "
                         "non-unsigned-integer as unsigned-integer")
    return value


def classify(array: np.ndarray, datatype: str, count: int, batched: bool,
             labels: list[str] | None) -> np.ndarray:
    """The top-`count` classes of `array` (see the module docstring): per batch entry when
    `batched`, else over all its elements; highest value first (ties: lower index first).
    Raises InferError(400) for a datatype Triton does not classify (BYTES, BOOL, FP16, BF16),
    with its text."""
    if datatype not in _CLASSIFIABLE:
        raise InferError("class result not available for output due to unsupported type "
                         f"'{datatype}'")
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim > 0 \
        else array.reshape(1, -1)
    k = min(count, rows.shape[1])
    fmt = "{:f}" if datatype in ("FP32", "FP64") else "{:d}"
    out = np.empty((rows.shape[0], k), dtype=np.object_)
    for b, row in enumerate(rows):
        order = sorted(range(row.size), key=row.__getitem__, reverse=True)[:k] \
            if row.dtype.kind in "ui" else np.argsort(-row, kind="stable")[:k]
        for j, idx in enumerate(order):
            text = f"{fmt.format(row[idx].item())}:{idx}"
            if labels is not None and idx < len(labels) and labels[idx]:
                text += f":{labels[idx]}"
            out[b, j] = text.encode()
    return out if batched and array.ndim > 0 else out[0]
