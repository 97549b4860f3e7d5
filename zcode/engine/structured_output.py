"""Structured output: a request's grammar (a JSON schema, any JSON object, a regex, a choice of
strings or a Lark grammar) masks the logits at every step, so the model can only write text the
grammar accepts.

llguidance does the matching: it compiles the grammar against the tokenizer's vocabulary once and
gives, per step, the bitmask of allowed tokens (fast enough to run per token on the CPU).
"""

import json

import llguidance
import llguidance.hf
import llguidance.torch as llg_torch
import torch

from zcode.errors import ValidationError
from zcode.sampling_params import StructuredOutputsParams

# Whitespace allowed between JSON tokens: one line break and an indent at most, so pretty-printed
# JSON is possible but sampling cannot wander into endless blank space.
JSON_WHITESPACE = r"\n?[ \t]{0,32}"


def grammar_of(params: StructuredOutputsParams) -> str:
    """The request's constraint as an llguidance grammar."""
    if params.json_object or params.json is not None:
        schema = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValidationError(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, dict):
            schema = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}, **schema}
        return llguidance.grammar_from("json", json.dumps(schema))
    if params.regex is not None:
        return llguidance.grammar_from("regex", params.regex)
    if params.grammar is not None:
        return llguidance.grammar_from("lark", params.grammar)
    alternatives = " | ".join(json.dumps(c) for c in params.choice)
    return llguidance.grammar_from("lark", f"start: {alternatives}")


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = llg_torch.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(V / 32)]
        self._vocab_size = vocab_size

    def mask_(self, logits: torch.Tensor) -> None:
        """Sets the logits of every token the grammar forbids now to -inf, in place. logits: [V]"""
        llg_torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        row = logits.view(1, -1)
        llg_torch.apply_token_bitmask_inplace(row[:, : self._vocab_size], self._bitmask)
        row[:, self._vocab_size :] = float("-inf")  # padded logits beyond the tokenizer

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"grammar rejected token {token}: {self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """True once the grammar allows nothing more (the text is complete)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Turns StructuredOutputsParams into per-request matchers for one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._hf_tokenizer = tokenizer
        self._tokenizer = None  # llguidance's view of the vocabulary, built on first use (~0.4 s)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        if self._hf_tokenizer is None:
            raise ValidationError("structured output needs a tokenizer; this model has none")
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
        try:
            grammar = grammar_of(params)
        except (ValueError, TypeError, RecursionError) as e:
            raise ValidationError(f"invalid structured output constraint: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValidationError(f"invalid structured output constraint: {error.strip()}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        # The first mask tells whether any text can start; it is where a dead grammar shows.
        llg_torch.fill_next_token_bitmask(
            matcher, llg_torch.allocate_token_bitmask(1, self._tokenizer.vocab_size), 0
        )
        if matcher.is_error() or matcher.is_stopped():
            # e.g. {"$ref": "#"}: a schema defined only by itself, which no text satisfies
            raise ValidationError(
                "invalid structured output constraint: it admits no output "
                f"({matcher.get_error().splitlines()[0] if matcher.is_error() else 'empty'})"
            )
        return GrammarMatcher(matcher, self._tokenizer.vocab_size)
