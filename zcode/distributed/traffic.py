"""Bytes a MoE layer moves between ranks per token, by scheme (issue 19): what `ParallelMoE` does
against the all-to-all dispatch of DeepSpeed-MoE / DeepEP, from the model's shape alone.

Both count the bytes all ranks send in all, per token and MoE layer, routing taken as uniform
(each token's top_k experts a random set of distinct experts):
- all-reduce (ours: hidden states replicated, each rank adds its experts' part): a ring
  all-reduce of the [D] output, each rank sending 2 (N - 1) / N of it;
- all-to-all (attention data-parallel: each token on one rank): the token's hidden state is sent
  to every other rank that holds one of its experts, and that rank's partial output sent back.
"""

from math import comb

from zcode.distributed.shard import split_sizes


def moe_bytes_per_token(
    hidden_size: int, num_experts: int, top_k: int, world_size: int, bytes_per_value: int
) -> dict[str, float]:
    """{"all_reduce": bytes, "all_to_all": expected bytes} sent per token by all ranks."""
    vector_bytes = hidden_size * bytes_per_value
    all_reduce = 2 * (world_size - 1) * vector_bytes
    # P(rank r holds one of a token's experts) = 1 - C(E - E_r, k) / C(E, k); the token's own
    # rank (any of the N, equally likely) needs no transfer.
    hit = [
        1 - comb(num_experts - n, top_k) / comb(num_experts, top_k)
        for n in split_sizes(num_experts, world_size)
    ]
    remote_ranks = sum(hit) * (world_size - 1) / world_size
    return {"all_reduce": all_reduce, "all_to_all": 2 * remote_ranks * vector_bytes}
