"""Speculative decoding: drafters propose tokens, the engine verifies them in one forward."""
