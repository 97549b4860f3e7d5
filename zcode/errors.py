class ValidationError(ValueError):
    """Bad user input (a request or parameter); the server maps it to HTTP 400."""
