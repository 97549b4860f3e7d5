"""One chat choice's generated text split into reasoning, content and tool calls.

Text goes through the reasoning parser (when the chat template knows `<think>`) and then the
GLM tool-call parser (when the request offers tools). Streamed and whole outputs take the same
path, `feed` then `finish`, so a stream's deltas add up to the non-streamed message. A forced
tool call (`tool_choice` required or named) is begun in the prompt, and that prefix is fed
first, as if the model had written it.

Reasoning goes out as `reasoning` (current vLLM) and `reasoning_content` (older vLLM, DeepSeek).
An output cut off by max_tokens is `finish_reason: "length"` even when it holds calls: the last
call may be incomplete, and a client must not run it as if it were whole.
"""

from zcode.chat.reasoning_parser import ReasoningParser
from zcode.chat.tool_parser import GlmToolParser, ToolStreamDelta


class ChoiceOutput:
    def __init__(
        self,
        reasoning: bool,
        starts_in_reasoning: bool,
        tools: list[dict] | None,
        prefix: str = "",
    ) -> None:
        self.reasoning = ReasoningParser(starts_in_reasoning) if reasoning else None
        self.tools = GlmToolParser(tools) if tools is not None else None
        self.prefix = prefix
        self.num_tool_calls = 0

    def feed(self, text: str) -> dict:
        """The chat delta (`reasoning`, `content`, `tool_calls`) that `text` releases."""
        text, self.prefix = self.prefix + text, ""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        tool_delta = self.tools.feed(content) if self.tools else ToolStreamDelta(content)
        return self._delta(reasoning, tool_delta)

    def finish(self) -> dict:
        """The chat delta held back until the end of generation."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if self.tools is None:
            return self._delta(reasoning, ToolStreamDelta(content))
        first, last = self.tools.feed(content), self.tools.finish()
        merged = ToolStreamDelta(first.content + last.content, first.tool_calls + last.tool_calls)
        return self._delta(reasoning, merged)

    def message(self, text: str) -> dict:
        """The whole assistant message for a finished output."""
        first, last = self.feed(text), self.finish()
        content = first.get("content", "") + last.get("content", "")
        reasoning = first.get("reasoning", "") + last.get("reasoning", "")
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        calls = self.tools.calls if self.tools else []
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ]
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.tools is not None and self.tools.calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def _delta(self, reasoning: str, tool_delta: ToolStreamDelta) -> dict:
        delta = {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if tool_delta.content:
            delta["content"] = tool_delta.content
        calls = []
        for d in tool_delta.tool_calls:
            call: dict = {"index": d.index}
            if d.id is not None:
                call.update(id=d.id, type="function")
            function = {"arguments": d.arguments}
            if d.name is not None:
                function["name"] = d.name
            call["function"] = function
            calls.append(call)
        if calls:
            delta["tool_calls"] = calls
        return delta
