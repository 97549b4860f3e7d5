"""POST /v1/completions: text or token-id prompts (one or many), echo, logprobs, streaming.

lm-evaluation-harness scores loglikelihoods with `echo=true, logprobs=1, max_tokens=1` on
token-id prompts and reads `logprobs.token_logprobs` / `top_logprobs` over the prompt, so with
echo the prompt's logprobs come first (the first token has none: `null`). `max_tokens=0` with
echo returns the prompt alone (the engine generates one token that is dropped).
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass

from zcode.engine.request_output import RequestOutput
from zcode.server.protocol import ApiError, CompletionRequest
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


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str


class Completions:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise ApiError("the prompt must not be empty", param="prompt")
        prompts = []
        for item in p:
            if isinstance(item, str):
                self.state.require_tokenizer()
                ids = self.state.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                prompts.append(_Prompt(ids, item))
            else:
                self.state.check_prompt(item, None)  # ids must be valid before decoding them
                text = self.state.tokenizer.decode(item) if self.state.tokenizer else ""
                prompts.append(_Prompt(list(item), text))
        return prompts

    async def create(self, req: CompletionRequest):
        state = self.state
        state.check_model(req.model)
        req.check()
        state.check_logit_bias(req.logit_bias)
        planned = state.plan(req)
        prompts = await asyncio.to_thread(self._prompts, req)  # tokenizing 1 MiB takes a while
        num_logprobs = req.logprobs
        prompt_logprobs = req.prompt_logprobs
        if req.echo and num_logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = num_logprobs
        jobs = []
        request_id = new_id("cmpl")
        for p_index, prompt in enumerate(prompts):
            max_tokens = req.max_tokens
            if max_tokens is None:
                max_tokens = state.max_model_len - len(prompt.token_ids)
            state.check_prompt(prompt.token_ids, max(max_tokens, 1))
            for i in range(req.n):
                params = req.sampling_params(max(max_tokens, 1), i, num_logprobs, prompt_logprobs)
                jobs.append((prompt.token_ids, params, f"{request_id}-{p_index}-{i}"))
        stack = AsyncExitStack()
        streams = await stack.enter_async_context(
            state.engine.requests(
                jobs, planned, req.cache_salt, **(planned.engine_args() if planned else req.skips())
            )
        )
        view = _View(state, req, request_id, prompts)
        if req.stream:
            return _stream(view, streams, stack)
        async with stack:
            return view.response(await final_outputs(streams))


class _View:
    """Turns engine outputs into OpenAI completion objects and chunks."""

    def __init__(self, state: ServerState, req: CompletionRequest, request_id: str, prompts):
        self.state, self.req, self.id, self.prompts = state, req, request_id, prompts
        self.created = now_s()
        self.keep_output = req.max_tokens != 0

    def prompt_of(self, index: int) -> _Prompt:
        return self.prompts[index // self.req.n]

    def output(self, out: RequestOutput) -> tuple[str, list[int], list | None]:
        if not self.keep_output:
            return "", [], [] if out.logprobs is not None else None
        return out.text, out.token_ids, out.logprobs

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for index, out in enumerate(finals):
            prompt = self.prompt_of(index)
            text, token_ids, logprobs = self.output(out)
            lp = None
            if self.req.logprobs is not None:
                lp = self._logprobs(token_ids, logprobs or [], 0)
                if self.req.echo:
                    lp = _join(self._prompt_logprobs(prompt, out), lp, len(prompt.text))
            if self.req.echo:
                text = prompt.text + text
            choices.append(self._choice(index, text, lp, out.finish_reason, out.stop_reason))
            if out.plan is not None:  # the plan this choice ran (hints, speculative decoding)
                choices[-1]["zcode_plan"] = out.plan.to_dict()
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_output = sum(len(self.output(out)[1]) for out in finals)
        return openai_object(
            "text_completion",
            self.id,
            self.created,
            self.state.model_name,
            choices,
            usage(num_prompt, num_output),
        )

    def _choice(self, index, text, logprobs, finish_reason=None, stop_reason=None) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def chunk(self, choices: list[dict], usage_stats: dict | None = None) -> dict:
        return openai_object(
            "text_completion", self.id, self.created, self.state.model_name, choices, usage_stats
        )

    def _logprobs(self, token_ids: list[int], logprobs: list[dict], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            token = self.state.token_str(token_id)
            offsets.append(offset)
            offset += len(token)
            tokens.append(token)
            token_lps.append(entry[token_id])
            tops.append({self.state.token_str(t): lp for t, lp in entry.items()})
        return {
            "text_offset": offsets,
            "token_logprobs": token_lps,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def _prompt_logprobs(self, prompt: _Prompt, out: RequestOutput) -> dict:
        entries = out.prompt_logprobs or []
        lp = self._logprobs(prompt.token_ids[1:], entries[1:], 0)
        first = self.state.token_str(prompt.token_ids[0])
        lp["tokens"].insert(0, first)
        lp["token_logprobs"].insert(0, None)
        lp["top_logprobs"].insert(0, None)
        lp["text_offset"] = [0] + [o + len(first) for o in lp["text_offset"]]
        return lp


def _join(first: dict, second: dict, second_offset: int) -> dict:
    return {
        "text_offset": first["text_offset"] + [o + second_offset for o in second["text_offset"]],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "tokens": first["tokens"] + second["tokens"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
    }


async def _stream(view: _View, streams, stack: AsyncExitStack) -> AsyncIterator[str]:
    req = view.req
    num_sent = [0] * len(streams)  # output tokens whose logprobs were sent, per choice
    text_len = [0] * len(streams)  # characters sent, per choice
    num_output = [0] * len(streams)
    try:
        async with stack, aclosing(merge(streams)) as outputs:
            if req.echo:
                for index in range(len(streams)):
                    prompt = view.prompt_of(index)
                    yield sse(view.chunk([view._choice(index, prompt.text, None)]))
                    text_len[index] = len(prompt.text)
            echo_logprobs_pending = set(range(len(streams))) if req.echo else set()
            async for index, out in outputs:
                text, token_ids, logprobs = view.output(out)
                delta = out.delta_text if view.keep_output else ""
                lp = None
                if req.logprobs is not None:
                    new_ids = token_ids[num_sent[index] :]
                    new_lps = (logprobs or [])[num_sent[index] :]
                    lp = view._logprobs(new_ids, new_lps, text_len[index])
                    num_sent[index] = len(token_ids)
                    if index in echo_logprobs_pending:
                        echo_logprobs_pending.discard(index)
                        lp = _join(view._prompt_logprobs(view.prompt_of(index), out), lp, 0)
                text_len[index] += len(delta)
                num_output[index] = len(token_ids)
                if not delta and not out.finished and not (lp and lp["tokens"]):
                    continue
                choice = view._choice(
                    index,
                    delta,
                    lp,
                    out.finish_reason if out.finished else None,
                    out.stop_reason if out.finished else None,
                )
                if out.finished and out.plan is not None:
                    choice["zcode_plan"] = out.plan.to_dict()
                running_usage = None
                if req.continuous_usage:
                    running_usage = usage(_num_prompt(view), sum(num_output))
                yield sse(view.chunk([choice], running_usage))
        if req.include_usage:
            yield sse(view.chunk([], usage(_num_prompt(view), sum(num_output))))
    except Exception as e:
        yield stream_error(e)
    yield sse("[DONE]")


def _num_prompt(view: _View) -> int:
    return sum(len(p.token_ids) for p in view.prompts)
