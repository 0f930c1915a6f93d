"""One `ModelStreamInfer` stream: requests started as they arrive, responses written as Triton
writes them.

Owns: a reader thread that decodes and submits each request at once (so a stream's requests
batch together, and the LLM sees them together); for a decoupled model (the LLM, decoupled
python models) a task on the server's event loop that turns each of its responses into a
stream response as it is produced; for other models one response per request, released in
request order (stream_infer_handler.cc: non-decoupled responses in order, decoupled ones as
ready). Every response carries `triton_final_response`; an error is `error_message` with the
request's id and the stream goes on. When the client goes away, running decoupled requests are
cancelled (the engine aborts them) and others finish, their regions released.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from tritonclient.grpc import service_pb2 as pb

from triton_compat.errors import InferError
from triton_compat.frontend.grpc.codec import decode_request, encode_response, set_parameter
from triton_compat.frontend.infer import Inference, OutputTensor
from triton_compat.core.validate import output_datatype

logger = logging.getLogger("continuum.triton.grpc")


def _final(response: pb.ModelStreamInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    set_parameter(response.infer_response.parameters, "triton_final_response", final)
    return response


def _as_infer_error(e: Exception) -> InferError:
    if isinstance(e, InferError):
        return e
    logger.error("stream request failed: %s: %s", type(e).__name__, e)
    return InferError(f"{type(e).__name__}: {e}", 500)


def _error(msg, e: Exception, refused: bool = False) -> tuple:
    """(the error response of a request, its InferError, or None when the request was
    refused before it ran) — an error of a request that ran ends a `triton_grpc_error`
    stream; a refusal does not (tritonserver 2.51's stream_infer_handler.cc checks the mode
    only on responses)."""
    error = _as_infer_error(e)
    response = pb.ModelStreamInferResponse(error_message=error.message)
    r = response.infer_response
    r.id, r.model_name, r.model_version = msg.id, msg.model_name, msg.model_version
    return _final(response, True), None if refused or error.refused else error


class Stream:
    """The state of one stream. `responses()` is the RPC's response iterator. With
    `on_error` (the client sent metadata `triton_grpc_error: true`), the first error ends the
    stream: `on_error(InferError)` is called instead of writing it (it aborts the RPC)."""

    def __init__(self, service, request_iterator, on_error=None) -> None:
        self.service, self.ctx, self.on_error = service, service.ctx, on_error
        self.events: queue.Queue = queue.Queue()   # (response, error or None); None = the end
        self.lock = threading.Lock()
        self.outstanding, self.reading = 0, True
        self.next_seq = self.flush_seq = 0
        self.done: dict[int, tuple] = {}
        self.pumps: set = set()                          # decoupled, running
        threading.Thread(target=self._read, args=(request_iterator,), daemon=True,
                         name="grpc-stream-reader").start()

    def responses(self, is_active=lambda: True):
        """Yield responses until the client has half-closed and every request is answered,
        or the RPC is over (`is_active()` False: the client cancelled or went away)."""
        try:
            while True:
                try:
                    event = self.events.get(timeout=0.5)
                except queue.Empty:
                    if not is_active():
                        return
                    continue
                if event is None:
                    return
                response, error = event
                if error is not None and self.on_error is not None:
                    self.on_error(error)
                yield response
        finally:
            self._abandon()

    def _read(self, request_iterator) -> None:
        try:
            for msg in request_iterator:
                with self.lock:
                    self.outstanding += 1
                self._start(msg)
        except Exception:                 # the client went away: nothing more to read
            pass
        finally:
            with self.lock:
                self.reading = False
            self._maybe_end()

    def _maybe_end(self) -> None:
        with self.lock:
            if not self.reading and self.outstanding == 0:
                self.events.put(None)

    def _start(self, msg) -> None:
        rt, error = None, None
        try:
            self.service._admit()
            rt = self.ctx.repository().runtime(msg.model_name, msg.model_version)
        except Exception as e:
            error = e
        if rt is not None and rt.decoupled:
            try:
                self._start_decoupled(msg, rt, decode_request(msg))
            except Exception as e:
                self._emit(_error(msg, e, refused=True))
            return
        with self.lock:                   # answered in request order, errors included
            seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            if error is not None:
                raise error
            request = decode_request(msg)
            inference = Inference(self.ctx.repository(), self.ctx.shm, request)
        except Exception as e:
            self._ordered(seq, _error(msg, e, refused=True))
            return
        inference.future.add_done_callback(
            lambda _: self._ordered(seq, self._response(msg, request, inference)))

    def _response(self, msg, request, inference: Inference) -> tuple:
        """(response, error) of a finished non-decoupled request (runs where it finished)."""
        try:
            version, tensors = inference.finish(inference.future.result())
            return _final(pb.ModelStreamInferResponse(infer_response=encode_response(
                request.model, version, request.id, tensors)), True), None
        except Exception as e:                   # its error, or a model bug: this request only
            return _error(msg, e)
        finally:
            inference.release()

    def _emit(self, event: tuple) -> None:
        """(response, error) of a decoupled request: written now."""
        self.events.put(event)
        if event[0].infer_response.parameters["triton_final_response"].bool_param:
            with self.lock:
                self.outstanding -= 1
            self._maybe_end()

    def _ordered(self, seq: int, event: tuple) -> None:
        """(response, error) of a non-decoupled request: written after earlier requests'."""
        with self.lock:
            self.done[seq] = event
            while self.flush_seq in self.done:
                self.events.put(self.done.pop(self.flush_seq))
                self.flush_seq += 1
                self.outstanding -= 1
        self._maybe_end()

    def _start_decoupled(self, msg, rt, request) -> None:
        wanted = [o.name for o in request.outputs] if request.outputs is not None else None
        empty_final = bool(request.parameters.get("triton_enable_empty_final_response", False))
        model_params = {k: v for k, v in request.parameters.items()
                        if not k.startswith("triton_")}

        async def pump():
            sent_final = False
            try:
                async for outputs, final in rt.generate(request.inputs, msg.id,
                                                        request.datatypes, model_params):
                    if outputs is None:          # a flag-only final: sent below if asked
                        continue
                    tensors = [OutputTensor(n, output_datatype(rt.signature, n, a), a, None)
                               for n, a in outputs.items()
                               if wanted is None or n in wanted]
                    sent_final = final
                    self._emit((_final(pb.ModelStreamInferResponse(
                        infer_response=encode_response(msg.model_name, "1", msg.id, tensors)),
                        final), None))
                if not sent_final:
                    empty = pb.ModelStreamInferResponse()
                    r = empty.infer_response       # the request's version, as Triton echoes
                    r.id, r.model_name, r.model_version = msg.id, msg.model_name, \
                        msg.model_version
                    if empty_final:
                        self._emit((_final(empty, True), None))
                    else:                        # nothing to send: just count it done
                        with self.lock:
                            self.outstanding -= 1
                        self._maybe_end()
            except asyncio.CancelledError:
                raise
            except Exception as e:               # its error, or a bug: this request only
                self._emit(_error(msg, e))

        future = asyncio.run_coroutine_threadsafe(pump(), self.ctx.lifecycle.loop)
        with self.lock:
            self.pumps.add(future)
        future.add_done_callback(lambda f: self.pumps.discard(f))

    def _abandon(self) -> None:
        """The stream ended (or the client left): cancel decoupled requests still running."""
        with self.lock:
            pumps = list(self.pumps)
        for future in pumps:
            future.cancel()
