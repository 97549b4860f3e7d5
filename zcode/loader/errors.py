class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not fit the model; the message names the file
    and, where there is one, the tensor."""
