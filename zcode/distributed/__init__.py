"""Several processes running one model (issue 19), over torch.distributed, launched by torchrun.

`config.py` says how the model is split, `group.py` joins the launch and runs the collectives,
`shard.py` cuts a loaded model into this rank's shard (tensor and expert parallelism),
`pipeline.py` into this rank's range of layers (pipeline parallelism), `layers.py`
holds the modules that make a shard's outputs whole, `traffic.py` counts the bytes they move,
and `steps.py` makes rank 0 lead and the others follow its steps.
"""
