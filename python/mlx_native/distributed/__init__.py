"""Context parallelism: one prefill's attention over several processes (GPUs), each holding
chunks of the sequence, by ring attention over ``torch.distributed`` (NCCL for CUDA
tensors, gloo for CPU tensors). Importing this module imports torch; ``mlx_native`` itself
does not.

- :func:`context_parallel_prefill`: each rank's rows of the whole sequence's attention.
- :func:`shard_sequence`, :func:`local_positions`, :func:`rank_chunks`,
  :func:`chunk_bounds`, :func:`local_rows`: how the sequence is cut (``layout``)."""

from .chunks import LAYOUTS, chunk_bounds, local_positions, local_rows, rank_chunks, shard_sequence
from .prefill import context_parallel_prefill
from .schedule import ring_schedule

__all__ = [
    "context_parallel_prefill",
    "LAYOUTS",
    "chunk_bounds",
    "local_positions",
    "local_rows",
    "rank_chunks",
    "ring_schedule",
    "shard_sequence",
]
