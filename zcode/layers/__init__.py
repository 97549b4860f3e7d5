"""Building blocks shared by every architecture: norms, rotary embeddings, attention, MLPs, MoE."""
