"""Chat: templates (sandboxed Jinja), message normalisation, GLM tool-call and reasoning parsers."""
