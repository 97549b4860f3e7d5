"""Splits GLM output into reasoning and content at `<think>` / `</think>`, streamed or whole.

Where the reasoning starts depends on the template: GLM-4.5/4.6 let the model write `<think>`
itself, GLM-4.7+/5 open `<think>` in the generation prompt, so the output starts inside the
reasoning (`starts_in_reasoning`, see `prompt_opens_reasoning`). Rules, in order:

- Only tags at the start of the output (after whitespace) switch mode: `<think>` opens reasoning,
  `</think>` (thinking off, or a model that skipped thinking) goes straight to content. Later in
  the content both tags are plain text, so an answer that quotes them stays intact.
- Inside reasoning, the first `</think>` ends it. If it never comes, everything is reasoning: a
  template-opened `<think>` with no close is R1-style (vLLM's `glm45` parser since vllm#31449),
  and a model that opened `<think>` itself and ran out of tokens was still thinking.
- Whitespace right after `</think>` is dropped, as GLM templates render `</think>` + content.
- A non-thinking model (`starts_in_reasoning=False`, no leading tag) gives all content.

Streaming holds back only what could still turn out to be a tag (a partial `</think>`, leading
whitespace, whitespace after `</think>`), so `feed` over any chunking equals `split`.
"""

from enum import Enum, auto


class _Mode(Enum):
    START = auto()  # only whitespace seen: a leading tag may still come
    REASONING = auto()
    AFTER_END = auto()  # just past `</think>`: whitespace is dropped
    CONTENT = auto()


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool, start: str = "<think>", end: str = "</think>"):
        self.starts_in_reasoning = starts_in_reasoning
        self.start = start
        self.end = end
        self._mode = _Mode.START
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning_delta, content_delta) that are safe to emit after `delta`."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Flushes what was held back; call once when generation ends."""
        return self._drain(final=True)

    @staticmethod
    def split(
        text: str, starts_in_reasoning: bool, start: str = "<think>", end: str = "</think>"
    ) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning is None when it is empty."""
        parser = ReasoningParser(starts_in_reasoning, start, end)
        reasoning, content = parser.feed(text)
        tail_reasoning, tail_content = parser.finish()
        return (reasoning + tail_reasoning) or None, content + tail_content

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._mode is _Mode.START:
                head = self._buf.lstrip()
                if head.startswith(self.start):
                    self._buf, self._mode = head[len(self.start) :], _Mode.REASONING
                elif head.startswith(self.end):
                    self._buf, self._mode = head[len(self.end) :], _Mode.AFTER_END
                elif not final and (
                    not head or self.start.startswith(head) or self.end.startswith(head)
                ):
                    break
                else:  # the leading whitespace belongs to the default mode
                    self._mode = _Mode.REASONING if self.starts_in_reasoning else _Mode.CONTENT
            elif self._mode is _Mode.REASONING:
                i = self._buf.find(self.end)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf, self._mode = self._buf[i + len(self.end) :], _Mode.AFTER_END
                    continue
                keep = 0 if final else partial_suffix_len(self._buf, self.end)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            elif self._mode is _Mode.AFTER_END:
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._mode = _Mode.CONTENT
            else:
                content.append(self._buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_opens_reasoning(prompt_text: str, start: str = "<think>", end: str = "</think>") -> bool:
    """True if the rendered prompt ends inside an open `<think>` (GLM-4.7+/5, thinking on).

    That is: the last `<think>` comes after the last `</think>`, and no special token (`<|...`)
    follows it. The second condition keeps a user message that merely quotes `<think>` (followed
    by the template's `<|assistant|>`) from turning the whole answer into reasoning, while a
    prefilled assistant message (`<|assistant|><think>partial thoughts`) still counts as open.
    """
    i = prompt_text.rfind(start)
    return i > prompt_text.rfind(end) and "<|" not in prompt_text[i + len(start) :]
