"""Tensor parallelism over `torch.distributed` (`--tensor-parallel-size N`).

Owns: the process group of the N ranks and its collectives (`parallel`; on the CPU through
shared memory, `shm` and `shm_comm.c`), the Megatron-style
split of a Llama checkpoint into per-rank shards (`parallel.shard_weights`), the worker process
of ranks 1..N-1 (`worker`), and rank 0's side: launching, feeding and watching the workers
(`executor`).

How a step flows: rank 0 is the engine core. Its scheduler builds the `SchedulerOutput`; the
`TensorParallelRunner` pickles it once and writes it down each worker's stdin (the control
plane: no collective waits while the server is idle, and EOF tells a worker that rank 0 is
gone), then every rank runs `ModelRunner.execute` on the same output with its own shard of the
weights and its own slice of the paged KV cache (its KV heads, every block), under the same
block tables. Inside the forward pass the ranks meet in collectives only (the data plane):
an all-reduce after the vocabulary-parallel embedding, after each row-parallel projection
(attention output, MLP down) and an all-gather of the vocabulary-parallel logits — CPU ranks
copy their part into a shared mapping and meet at a barrier there, not over gloo's sockets.
Every rank
samples; only rank 0's tokens reach the scheduler.
"""
