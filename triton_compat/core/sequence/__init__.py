"""Triton's sequence batcher on top of the model runtime: `spec` (control inputs, implicit
state, sequence parameters) and `runtime` (`SequenceRuntime`)."""
