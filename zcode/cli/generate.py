"""`zcode generate` and `zcode chat`."""

import argparse
import json
import signal
import sys

from zcode.cli import options
from zcode.cli.options import (
    SAMPLING_HELP,
    add_compile_option,
    add_dtype_option,
    add_expert_cache_option,
    add_kv_cache_dtype_option,
    add_model_option,
    add_parallel_options,
    add_quality_options,
    add_sampling_options,
    add_skip_options,
    add_sparsity_option,
    add_speculative_options,
    add_thinking_option,
    attach_precision,
    check_quality_options,
    compile_args,
    expert_cache_args,
    kv_cache_dtype_args,
    parallel_args,
    sampling_params,
    skip_args,
    sparsity_args,
    speculative_args,
    write,
)
from zcode.cli.plan import add_hint_options, hint_args
from zcode.errors import ValidationError


def add_commands(commands) -> None:
    generate = commands.add_parser(
        "generate",
        help="generate a continuation of a prompt",
        description=f"Print the model's continuation of PROMPT. {SAMPLING_HELP}",
    )
    generate.add_argument(
        "prompt", metavar="PROMPT", help="the prompt text; '-' reads it from stdin"
    )
    add_model_option(generate)
    add_sampling_options(generate, max_tokens=256)
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the model's chat template "
        "(default: PROMPT is raw text to continue)",
    )
    add_thinking_option(generate)
    add_dtype_option(generate)
    add_kv_cache_dtype_option(generate)
    add_expert_cache_option(generate)
    add_sparsity_option(generate)
    add_speculative_options(generate)
    generate.add_argument(
        "--stream", action="store_true", help="print the text token by token as it is generated"
    )
    add_compile_option(generate)
    add_quality_options(generate)
    add_hint_options(generate)
    add_skip_options(generate)
    add_parallel_options(generate, "generate")
    generate.set_defaults(run=_generate)

    chat = commands.add_parser(
        "chat",
        help="interactive chat that keeps the conversation",
        description="Chat with the model: each stdin line is a user turn and the reply streams "
        "as it is generated. '/reset' clears the conversation, '/exit' or end of input quits. "
        f"Works with a pipe on stdin. {SAMPLING_HELP}",
    )
    add_model_option(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    add_sampling_options(chat, max_tokens=1024)
    add_thinking_option(chat)
    add_dtype_option(chat)
    add_kv_cache_dtype_option(chat)
    add_expert_cache_option(chat)
    chat.set_defaults(run=_chat)


def _generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)  # before loading, so a bad value fails at once
    if args.thinking is not None and not args.chat:
        raise ValidationError("--thinking/--no-thinking apply to the chat template: add --chat")
    skips = skip_args(args)
    hints = hint_args(args)
    from zcode.harness.planner import Hints  # torch: after parsing

    Hints(**hints)  # a bad hint fails before loading
    if args.stream and hints:
        raise ValidationError("--stream cannot be combined with planning hints yet")
    check_quality_options(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    # Only a non-default option is passed on, so the default call matches the other commands'.
    llm = options.load_llm(
        args.model,
        args.dtype,
        **compile_args(args),
        **({"per_request_depth": True} if skips else {}),
        **expert_cache_args(args),
        **kv_cache_dtype_args(args),
        **sparsity_args(args),
        **parallel_args(args),
        **speculative_args(args),
    )
    prompt = [{"role": "user", "content": text}] if args.chat else text
    attach_precision(llm, args)
    if args.stream:
        for out in llm.stream(prompt, params, args.thinking, **skips):
            write(out.delta_text)
        write("\n")
    else:
        out = llm.generate(prompt, params, args.thinking, **hints, **skips)[0]
        if out.plan is not None:  # the plan that ran (hints), speculative decoding counts
            print(json.dumps(out.plan.to_dict()), file=sys.stderr)
        print(out.text)


def _chat(args: argparse.Namespace) -> None:
    params = sampling_params(args)
    llm = options.load_llm(
        args.model, args.dtype, **expert_cache_args(args), **kv_cache_dtype_args(args)
    )
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template: use 'zcode generate'")
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print("/reset clears the conversation; /exit or Ctrl-D quits; Ctrl-C stops a reply")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    while (line := _read_turn("> " if interactive else "")) is not None:
        if line == "/exit":
            break
        if line == "/reset":
            messages = list(opening)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            with _CtrlCStopsReply() as ctrl_c:
                for out in llm.stream(messages, params, args.thinking):
                    write(out.delta_text)
                    reply.append(out.delta_text)
                    if ctrl_c.pressed:
                        break  # closing the stream aborts the request
        except ValidationError as e:  # e.g. the conversation outgrew the context
            messages.pop()
            print(f"zcode: error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def _read_turn(prompt: str) -> str | None:
    """The user's next line, stripped; None at end of input. Ctrl-C at the prompt clears the
    line, as in a shell, and keeps the conversation."""
    while True:
        try:
            return input(prompt).strip()
        except EOFError:
            if prompt:
                print()  # the shell prompt starts on a line of its own
            return None
        except KeyboardInterrupt:
            print()


class _CtrlCStopsReply:
    """While a reply streams, Ctrl-C sets `pressed` instead of raising: the stream stops after
    the step in flight (never inside one, which would leave the engine half-updated), the words
    so far stay in the conversation, and the prompt comes back."""

    def __enter__(self) -> "_CtrlCStopsReply":
        self.pressed = False
        self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame) -> None:
        self.pressed = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)
