class ValidationError(ValueError):
    """Bad user input (a request or parameter); the server maps it to HTTP 400."""


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not fit the model; the message names the file
    and, where there is one, the tensor."""


class RankFailure(RuntimeError):
    """A collective failed: another rank died, hung past the timeout, or the link broke."""
