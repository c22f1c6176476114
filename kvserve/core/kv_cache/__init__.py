"""KV cache bookkeeping in block ids (never tensors): the block pool with its prefix hashes and
free queue, and the manager that allocates a request's blocks and finds its prefix hits."""
