"""Turns a growing list of token ids into text deltas that are always whole UTF-8 characters.

Byte-level BPE splits multi-byte characters across tokens; decoding a token alone gives U+FFFD.
As vLLM does, we decode a short window of earlier tokens with the new ones and emit only the
text past the window, holding back while the tail is an incomplete character.
"""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-6:])  # context so the first word decodes right
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends a token; returns the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        return delta

    def truncate(self, length: int) -> None:
        """Cuts the text (a stop string was hit); tokens already emitted stay as they are."""
        self.output_text = self.output_text[:length]
