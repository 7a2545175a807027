"""Tensor parallel over torch.distributed (`--tp N`): N ranks, each holding a shard of every
GEMM weight and of the attention heads' cache, that draw the token one rank draws, bitwise.

    launch.py       rank 0 spawns the other ranks on this host, watches them (process exit,
                    heartbeats) and restarts the group on request
    group.py        one rank's place in the group: the plan channel and the round's collectives
    shard.py        what a rank keeps of each weight, and the block classes that keep heads
    backend.py      rank 0's Backend (the engine's seam) and the other ranks' loop

How it stays exact: no sum is ever split across ranks. Every GEMM is column-parallel (a rank
computes some outputs, each over its whole K, with the kernels one rank uses) and its outputs are
gathered; an input that is sharded (an attention layer's head outputs, an MLP's intermediate) is
gathered whole before the GEMM that sums over it. Gathering moves bits, it adds nothing, so
every activation equals the one-rank value. The LM head is split by vocabulary and the draw is
sampling/sampler.py's shard exchange, whose integer cut rule gives the one-rank token.
"""
