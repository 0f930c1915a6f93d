"""A trace in flight and the files traces end in (Triton's trace mode).

Owns: `Trace` (one sampled request: its id, its activity timestamps in nanoseconds of the
monotonic clock — the clock of tritonserver's `steady_clock` —, the tensors at TENSORS level)
and `TraceFile` (one `file` setting: the main file, a JSON array closed when the server stops,
and the indexed files `<file>.<n>` that `log_frequency` and `trace_count` write).
The JSON is tritonserver 2.51's (`tracer.cc`): per trace, an object with the model's name,
version and the request's id, then one `{"id": N, "timestamps": [{"name": ..., "ns": ...}]}`
object per activity, in the order they were recorded.
In: marks from the front ends, `infer.py` and the model runtime. Out: the trace's objects to its
setting (`TraceSetting.write`) or its events to OpenTelemetry (`otel.py`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger("continuum.triton.trace")


class TraceFile:
    """One trace file path. `save(parts, indexed)`: the parts (JSON objects as text) as one
    more chunk of the main file, or as a new indexed file `<path>.<n>` (n from 0). Writing
    errors are logged, as tritonserver logs them."""

    def __init__(self, path: str) -> None:
        self.path, self.index, self._fh = path, 0, None
        self._lock = threading.Lock()

    def save(self, parts: list[str], indexed: bool) -> None:
        """Write `parts` (JSON objects as text): as `<path>.<n>` when `indexed`, else appended
        to the main file's array. OSError is logged, not raised."""
        text = ",".join(parts)
        try:
            with self._lock:
                if indexed:
                    name, self.index = f"{self.path}.{self.index}", self.index + 1
                    Path(name).write_text(f"[{text}]")
                    return
                if self._fh is None:
                    self._fh = open(self.path, "w")
                    self._fh.write("[")
                else:
                    self._fh.write(",")
                self._fh.write(text)
                self._fh.flush()
        except OSError as e:
            logger.error("failed creating trace file: %s", e)

    def close(self) -> None:
        """End the main file's JSON array (the server stops)."""
        with self._lock:
            if self._fh is not None:
                self._fh.write("]")
                self._fh.close()
                self._fh = None


class Trace:
    """One sampled request. `mark(name)` records an activity (at TIMESTAMPS level); `start`
    the request's model, version and id with REQUEST_START; `queued` and `computed` the model
    runtime's activities; `tensor` a tensor at TENSORS level; `finish()` hands the trace to its
    setting (once, after the front end sent the response). Thread-safe: the marks come from
    the loop and the model's threads."""

    __slots__ = ("id", "setting", "exporter", "context", "parts", "events", "info",
                 "timestamps", "tensors", "_lock", "_done", "_answered")

    def __init__(self, trace_id: int, setting, exporter=None, context=None) -> None:
        """`exporter`: the OpenTelemetry exporter in opentelemetry mode; `context`: the
        OpenTelemetry context a `traceparent` header gave (the root span's parent)."""
        self.id, self.setting = trace_id, setting
        self.exporter, self.context = exporter, context
        self.timestamps = "TIMESTAMPS" in setting.level
        self.tensors = "TENSORS" in setting.level
        self.parts: list[str] = []               # Triton's JSON objects, as text (triton mode)
        self.events: list[tuple[str, int]] = []  # (activity, ns) (opentelemetry mode)
        self.info: dict = {}
        self._lock = threading.Lock()
        self._done = self._answered = False

    def mark(self, name: str, ns: int | None = None) -> None:
        """Record activity `name` at `ns` (default: now; `time.perf_counter_ns`, the
        monotonic clock)."""
        if not self.timestamps:
            return
        ns = time.perf_counter_ns() if ns is None else ns
        with self._lock:
            if self.exporter is not None:
                self.events.append((name, ns))
            else:
                self.parts.append(
                    f'{{"id":{self.id},"timestamps":[{{"name":"{name}","ns":{ns}}}]}}')

    def start(self, model: str, version: int, request_id: str) -> None:
        """The request reached its model: its description, then REQUEST_START."""
        info = {"id": self.id, "model_name": model, "model_version": version}
        if request_id:
            info["request_id"] = request_id
        self.info = info
        if self.timestamps and self.exporter is None:
            with self._lock:
                self.parts.append(json.dumps(info, separators=(",", ":")))
        self.mark("REQUEST_START")

    def answered(self) -> None:
        """INFER_RESPONSE_COMPLETE and REQUEST_END, once: the request's answer is handed
        back (by the model runtime, or by `infer.Inference.outcome` for a runtime that does not)."""
        with self._lock:
            if self._answered:
                return
            self._answered = True
        self.mark("INFER_RESPONSE_COMPLETE")
        self.mark("REQUEST_END")

    def queued(self, inputs: dict, datatypes: dict[str, str], datatype_of) -> None:
        """The model runtime queued the request: QUEUE_START, and at TENSORS level each input
        (TENSOR_QUEUE_INPUT) with its wire datatype (`datatypes`, else `datatype_of(array)`)."""
        self.mark("QUEUE_START")
        if self.tensors:
            for name, array in inputs.items():
                self.tensor("TENSOR_QUEUE_INPUT", name, array,
                            datatypes.get(name) or datatype_of(array))

    def computed(self, start: int, times, end: int) -> None:
        """The request's batch ran from `start` to `end` (ns): COMPUTE_START,
        COMPUTE_INPUT_END and COMPUTE_OUTPUT_START where the backend split the execution
        (`times`: its `ExecTimes`, or None), and COMPUTE_END."""
        self.mark("COMPUTE_START", start)
        if times is not None:
            input_end = start + times.input_ns
            self.mark("COMPUTE_INPUT_END", input_end)
            self.mark("COMPUTE_OUTPUT_START", input_end + times.infer_ns)
        self.mark("COMPUTE_END", end)

    def tensor(self, activity: str, name: str, array: np.ndarray, datatype: str) -> None:
        """Record a tensor (TENSOR_QUEUE_INPUT, TENSOR_BACKEND_INPUT, TENSOR_BACKEND_OUTPUT)
        at TENSORS level, its data written as tritonserver writes it (C++ stream formatting:
        six significant digits; BYTES elements quoted; FP16 / BF16 left empty)."""
        if not self.tensors:
            return
        entry = {"id": self.id, "activity": activity, "tensor": {
            "name": name, "data": _tensor_text(array, datatype),
            "shape": ",".join(str(d) for d in np.shape(array)), "dtype": datatype}}
        with self._lock:
            self.parts.append(json.dumps(entry, separators=(",", ":")))

    def finish(self) -> None:
        """The request is answered: the trace goes to its setting (once)."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self.setting.write(self, self.exporter)


def _tensor_text(array, datatype: str) -> str:
    flat = np.asarray(array).reshape(-1)
    if datatype in ("FP16", "BF16"):
        return ""
    if datatype == "BYTES":
        return ",".join('\\"' + (x.decode("utf-8", "replace") if isinstance(x, bytes)
                                 else str(x)) + '\\"' for x in flat)
    if datatype in ("FP32", "FP64"):
        return ",".join(format(float(x), ".6g") for x in flat)
    if datatype == "BOOL":
        return ",".join("1" if x else "0" for x in flat)
    return ",".join(str(int(x)) for x in flat)
