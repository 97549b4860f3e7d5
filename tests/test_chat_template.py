"""Chat templates render like transformers renders them, and run sandboxed."""

import pytest

from zcode.chat.template import TemplateError, render_chat
from zcode.errors import ValidationError
from zcode.loader.checkpoint import resolve_model_path
from zcode.loader.gguf_file import load_gguf_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Bonjour, ça va ? 🤖"},
    {"role": "assistant", "content": "Oui."},
    {"role": "user", "content": "Et toi ?"},
]

# The shape of GLM-4.5's template around thinking: an empty think block turns it off.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2():
    return load_gguf_tokenizer(resolve_model_path(None))


def test_smollm2_template_renders_as_transformers_does(smollm2):
    text = render_chat(smollm2.chat_template, MESSAGES)
    assert text == smollm2.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nBonjour, ça va ? 🤖<|im_end|>\n"
        "<|im_start|>assistant\nOui.<|im_end|>\n"
        "<|im_start|>user\nEt toi ?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_adds_its_default_system_prompt(smollm2):
    text = render_chat(smollm2.chat_template, MESSAGES[1:2], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert not text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("enable_thinking", "suffix"),
    [(None, "<|assistant|>"), (True, "<|assistant|>"), (False, "<|assistant|><think></think>")],
)
def test_enable_thinking_reaches_the_template(enable_thinking, suffix):
    text = render_chat(THINKING_TEMPLATE, MESSAGES[1:2], enable_thinking=enable_thinking)
    assert text == "<|user|>Bonjour, ça va ? 🤖" + suffix


def test_extra_variables_and_tojson():
    template = "{{ bos_token }}{{ tools | tojson }}{{ custom }}"
    tools = [{"name": "météo"}]
    text = render_chat(
        template, MESSAGES, tools=tools, special_tokens={"bos_token": "<s>"}, custom=1
    )
    assert text == '<s>[{"name": "météo"}]1'


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ self.__init__.__globals__ }}",
        "{{ '{0.__class__}'.format(1) }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses_escapes(source):
    messages = [dict(m) for m in MESSAGES]
    with pytest.raises(TemplateError, match="unsafe"):
        render_chat(source, messages)
    assert messages == MESSAGES


def test_raise_exception_is_a_template_error():
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Roles must alternate') }}"
        "{% endif %}"
    )
    with pytest.raises(TemplateError, match="^Roles must alternate$") as info:
        render_chat(template, MESSAGES)
    assert isinstance(info.value, ValidationError)  # the server answers 400


@pytest.mark.parametrize(
    ("template", "match"),
    [("{% for %}", "does not parse"), ("{{ 1 / 0 }}", "failed to render")],
)
def test_broken_templates_are_template_errors(template, match):
    with pytest.raises(TemplateError, match=match):
        render_chat(template, MESSAGES)


@pytest.mark.parametrize("messages", [[], "hi", [{"content": "no role"}]])
def test_malformed_messages(messages):
    with pytest.raises(ValidationError):
        render_chat("{{ messages }}", messages)


NESTED_LOOPS = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{{ messages[0].content }}"
)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        (NESTED_LOOPS, "longer than 0.2 s"),
        (
            "{% for m in messages %}{% for i in range(100000) %}x{% endfor %}{% endfor %}",
            "longer than",
        ),
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "longer than 100000 char"),
        ("{{ 'x' * 1000000000 }}", "longer than 100000 char"),
        ("{{ [1] * 1000000000 }}", "longer than 100000 char"),
        ("{{ 2 ** 100000000 }}", "power"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed to render"),
    ],
    ids=["nested-ranges", "loop-per-message", "output", "str-mul", "list-mul", "pow", "recursion"],
)
def test_runaway_templates_fail_within_their_budget(template, match):
    with pytest.raises(TemplateError, match=match):
        render_chat(template, MESSAGES, time_limit_s=0.2, max_chars=100_000)
    assert render_chat("{{ range(3) | list }}{{ range(5)[-1] }}", MESSAGES) == "[0, 1, 2]4"
