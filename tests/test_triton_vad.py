"""The `vad` example (examples/model_repository/vad): Silero VAD on the onnxruntime backend
with its recurrent state and audio context as implicit state, under the direct sequence
batcher. Many audio streams sent at once, chunk by chunk, over gRPC to the session server;
each stream's speech probabilities must equal the silero-vad package's own `OnnxWrapper` run
over that stream alone, and the statistics must show that streams shared executions.
"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from benchmarks.sequence_batching_bench import synthetic_audio

pytestmark = pytest.mark.slow
STREAMS, CHUNKS = 8, 24


def reference(audio: np.ndarray) -> np.ndarray:
    """The package's wrapper over one stream: probability per chunk."""
    import torch
    from silero_vad.utils_vad import OnnxWrapper

    from examples.prepare_model_repository import silero_onnx

    wrapper = OnnxWrapper(str(silero_onnx()), force_onnx_cpu=True)
    return np.array([float(wrapper(torch.from_numpy(chunk), 16000)[0, 0]) for chunk in audio])


def stream(address: str, sid: int, audio: np.ndarray) -> np.ndarray:
    """Send one stream as a sequence, a request per chunk; its probabilities."""
    c = grpcclient.InferenceServerClient(address)
    try:
        out = []
        for k, chunk in enumerate(audio):
            x = grpcclient.InferInput("audio", [1, 512], "FP32")
            x.set_data_from_numpy(chunk[None])
            r = c.infer("vad", [x], sequence_id=sid, sequence_start=k == 0,
                        sequence_end=k == len(audio) - 1)
            out.append(float(r.as_numpy("probability")[0, 0]))
        return np.array(out)
    finally:
        c.close()


def test_concurrent_streams_equal_their_standalone_runs(server, server_grpc):
    audios = [synthetic_audio(seed, CHUNKS) for seed in range(STREAMS)]
    before = httpx.get(f"{server}/v2/models/vad/stats").json()["model_stats"][0]
    with cf.ThreadPoolExecutor(STREAMS) as ex:
        got = list(ex.map(lambda s: stream(server_grpc, 7000 + s, audios[s]), range(STREAMS)))
    after = httpx.get(f"{server}/v2/models/vad/stats").json()["model_stats"][0]
    for audio, probs in zip(audios, got):
        want = reference(audio)
        np.testing.assert_allclose(probs, want, atol=2e-5)
    assert max(max(p) for p in got) > 0.5 and min(min(p) for p in got) < 0.1   # speech & not
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == STREAMS * CHUNKS and executions < inferences
