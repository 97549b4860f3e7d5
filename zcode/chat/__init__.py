"""Chat templates (sandboxed Jinja) and, later, GLM tool-call and reasoning parsers."""
