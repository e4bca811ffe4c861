"""Tensor parallelism on torch.distributed: the ranks' process group and its collectives."""
