"""POST /v1/chat/completions: the chat template applied server-side, `n` choices, streaming.

Messages are normalised (content parts to strings, tool-call arguments to dicts) before the
template renders them; the output is split into reasoning, content and GLM tool calls.

`n` fans out into n engine requests over the same prompt, choice i seeded with `seed + i`.
`usage.prompt_tokens` is the length of our tokenization of the rendered prompt, counted once.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing

from zcode.chat.messages import normalize_messages
from zcode.chat.reasoning_parser import prompt_opens_reasoning
from zcode.chat.tool_grammar import tool_call_grammar
from zcode.chat.tool_parser import CALL_START
from zcode.engine.request_output import RequestOutput
from zcode.errors import ValidationError
from zcode.sampling_params import StructuredOutputsParams
from zcode.server.chat_output import ChoiceOutput
from zcode.server.protocol import ApiError, ChatCompletionRequest, NamedToolChoice
from zcode.server.serving import (
    ServerState,
    final_outputs,
    merge,
    new_id,
    now_s,
    openai_object,
    sse,
    stream_error,
    usage,
)

# Variables the server passes to the template itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "special_tokens"}


class Chat:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        template = getattr(state.tokenizer, "chat_template", None) or ""
        self.reasoning = "<think>" in template  # split reasoning_content for thinking models
        self.glm_tools = "<arg_key>" in template  # the template writes GLM tool calls

    def render(self, req: ChatCompletionRequest, tools: list[dict] | None, forced: bool) -> str:
        self.state.require_tokenizer()
        kwargs = dict(req.chat_template_kwargs or {})
        clash = _RESERVED_TEMPLATE_VARS & kwargs.keys()
        if clash:
            raise ApiError(
                f"chat_template_kwargs may not set {sorted(clash)}", param="chat_template_kwargs"
            )
        enable_thinking = kwargs.pop("enable_thinking", False if forced else None)
        messages = normalize_messages(req.messages)
        text = self.state.llm.apply_chat_template(
            messages,
            enable_thinking=enable_thinking,
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            **kwargs,
        )
        if req.continue_final_message:
            final = messages[-1].get("content")
            end = text.rfind(final) if final else -1
            if end < 0:
                raise ApiError(
                    "continue_final_message needs a final message with text content",
                    param="messages",
                )
            text = text[: end + len(final)]
        return text

    def _forced_call(
        self, req: ChatCompletionRequest, prompt_text: str
    ) -> tuple[str, StructuredOutputsParams | None]:
        """For `required` or a named tool_choice: the start of the call, and the grammar that
        constrains the rest of it.

        The GLM call is begun in the prompt (its name too, when named), after closing a
        reasoning block the template left open; the grammar (`tool_grammar`) admits only calls
        to the request's tools with arguments valid against their schemas.
        """
        if req.tool_choice in (None, "none", "auto"):
            return "", None
        if req.structured_outputs_params() is not None:
            raise ApiError(
                "a forced tool_choice cannot be combined with another output constraint",
                param="tool_choice",
            )
        named = isinstance(req.tool_choice, NamedToolChoice)
        name = req.tool_choice.function["name"] if named else None
        try:
            grammar = tool_call_grammar(req.raw_tools, name, req.parallel_tool_calls)
        except ValidationError as e:
            raise ApiError(str(e), param="tools") from None
        prefix = "</think>" if self.reasoning and prompt_opens_reasoning(prompt_text) else ""
        return prefix + CALL_START + (name or ""), StructuredOutputsParams(grammar=grammar)

    def _prompt(self, req: ChatCompletionRequest, tools: list[dict] | None, forced: bool):
        """(prompt text, forced-call prefix, its grammar, prompt token ids)."""
        prompt_text = self.render(req, tools, forced)
        call_prefix, call_grammar = self._forced_call(req, prompt_text) if forced else ("", None)
        prompt_text += call_prefix
        prompt_ids = self.state.tokenizer.encode(prompt_text, add_special_tokens=False)
        return prompt_text, call_prefix, call_grammar, prompt_ids

    async def create(self, req: ChatCompletionRequest):
        state = self.state
        state.check_model(req.model)
        req.check()
        state.check_logit_bias(req.logit_bias)
        planned = state.plan(req)
        use_tools = bool(req.tools) and req.tool_choice != "none"
        if use_tools and not self.glm_tools:
            raise ApiError(
                "this model's chat template cannot carry tools: it does not write GLM tool calls "
                "(<tool_call> with <arg_key>/<arg_value>), so `tools` would be ignored",
                param="tools",
            )
        tools = req.raw_tools if use_tools else None
        forced = use_tools and req.tool_choice not in (None, "auto")
        # A template is untrusted code and a long prompt takes a while to tokenize: both run in
        # a worker thread (the render within its budget), so the event loop keeps serving.
        prompt_text, call_prefix, call_grammar, prompt_ids = await asyncio.to_thread(
            self._prompt, req, tools, forced
        )
        max_tokens = req.requested_max_tokens
        state.check_prompt(prompt_ids, max_tokens)
        if max_tokens is None:
            max_tokens = state.max_model_len - len(prompt_ids)
        request_id = new_id("chatcmpl")
        jobs = []
        for i in range(req.n):
            params = req.sampling_params(max_tokens, i, req.num_logprobs, None)
            if call_grammar is not None:
                params = dataclasses.replace(params, structured_outputs=call_grammar)
            jobs.append((prompt_ids, params, f"{request_id}-{i}"))
        starts_in_reasoning = self.reasoning and prompt_opens_reasoning(prompt_text)
        # The forced prefix closed any reasoning block; what it begins is a tool call.
        call_prefix = call_prefix.removeprefix("</think>")

        def parser() -> ChoiceOutput:
            return ChoiceOutput(self.reasoning, starts_in_reasoning, tools, call_prefix)

        stack = AsyncExitStack()
        streams = await stack.enter_async_context(
            state.engine.requests(
                jobs, planned, req.cache_salt, **(planned.engine_args() if planned else req.skips())
            )
        )
        view = _View(state, req, request_id, len(prompt_ids), parser)
        if req.stream:
            return _stream(view, streams, stack)
        async with stack:
            return view.response(await final_outputs(streams))


class _View:
    """Turns engine outputs into OpenAI chat completion objects and chunks."""

    def __init__(
        self, state: ServerState, req: ChatCompletionRequest, request_id: str, num_prompt, parser
    ):
        self.state, self.req, self.id = state, req, request_id
        self.num_prompt_tokens = num_prompt
        self.parser = parser
        self.created = now_s()

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for index, out in enumerate(finals):
            output = self.parser()
            message = output.message(out.text)
            logprobs = None
            if self.req.logprobs:
                logprobs = {"content": self.logprobs(out.token_ids, out.logprobs or [])}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": output.finish_reason(out.finish_reason),
                    "stop_reason": out.stop_reason,
                }
            )
            if out.plan is not None:  # the plan this choice ran (hints, speculative decoding)
                choices[-1]["zcode_plan"] = out.plan.to_dict()
        return openai_object(
            "chat.completion",
            self.id,
            self.created,
            self.state.model_name,
            choices,
            usage(self.num_prompt_tokens, sum(len(o.token_ids) for o in finals)),
        )

    def chunk(self, choices: list[dict], usage_stats: dict | None = None) -> dict:
        return openai_object(
            "chat.completion.chunk",
            self.id,
            self.created,
            self.state.model_name,
            choices,
            usage_stats,
        )

    def logprobs(self, token_ids: list[int], logprobs: list[dict]) -> list[dict]:
        num_top = self.req.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
            content.append(
                {
                    **self._entry(token_id, entry[token_id]),
                    "top_logprobs": [self._entry(t, lp) for t, lp in top],
                }
            )
        return content

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.state.token_str(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


async def _stream(view: _View, streams, stack: AsyncExitStack) -> AsyncIterator[str]:
    req = view.req
    num_choices = len(streams)
    num_sent = [0] * num_choices  # output tokens whose logprobs were sent, per choice
    num_output = [0] * num_choices
    outputs_text = [view.parser() for _ in range(num_choices)]
    try:
        async with stack, aclosing(merge(streams)) as outputs:
            for index in range(num_choices):
                delta = {"role": "assistant", "content": ""}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                yield sse(view.chunk([choice]))
            async for index, out in outputs:
                logprobs = None
                if req.logprobs:
                    new_ids = out.token_ids[num_sent[index] :]
                    new_lps = (out.logprobs or [])[num_sent[index] :]
                    logprobs = {"content": view.logprobs(new_ids, new_lps)}
                    num_sent[index] = len(out.token_ids)
                num_output[index] = len(out.token_ids)
                parser = outputs_text[index]
                delta = parser.feed(out.delta_text)
                if out.finished:
                    _merge_delta(delta, parser.finish())
                if not delta and not out.finished and not (logprobs and logprobs["content"]):
                    continue
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": parser.finish_reason(out.finish_reason)
                    if out.finished
                    else None,
                }
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                    if out.plan is not None:
                        choice["zcode_plan"] = out.plan.to_dict()
                running_usage = None
                if req.continuous_usage:
                    running_usage = usage(view.num_prompt_tokens, sum(num_output))
                yield sse(view.chunk([choice], running_usage))
        if req.include_usage:
            yield sse(view.chunk([], usage(view.num_prompt_tokens, sum(num_output))))
    except Exception as e:
        yield stream_error(e)
    yield sse("[DONE]")


def _merge_delta(delta: dict, more: dict) -> None:
    for key, value in more.items():
        delta[key] = delta[key] + value if key in delta else value
