"""Pipeline parallelism: the outermost axis of the grid (``G_pipe`` stages of consecutive
blocks), run by ``torch.distributed.pipelining``'s stages and schedules."""
