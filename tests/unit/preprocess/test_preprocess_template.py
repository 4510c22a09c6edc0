"""Chat templates: ChatML rendering, Hugging Face compatibility helpers, the sandbox."""

from __future__ import annotations

import datetime

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.preprocess import ChatTemplate, bundled_model_path, load_model_folder

USER = {"role": "user", "content": "Hi there"}


@pytest.fixture(scope="module")
def chatml() -> ChatTemplate:
    info = load_model_folder(bundled_model_path())
    assert info.chat_template is not None
    return ChatTemplate(info.chat_template, origin=str(info.path), variables=info.special_tokens())


def render(source: str, messages: list[dict] | None = None, **extra: object) -> str:
    return ChatTemplate(source, origin="/models/evil").render(messages or [USER], **extra)


def test_chatml_with_generation_prompt(chatml: ChatTemplate) -> None:
    messages = [{"role": "system", "content": "Be brief."}, USER]
    assert chatml.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chatml.render(messages, add_generation_prompt=False).endswith("Hi there<|im_end|>\n")


def test_chatml_content_parts_and_null_content(chatml: ChatTemplate) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        },
        {"role": "assistant", "content": None},
    ]
    assert chatml.render(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    )


def test_render_many_times_is_stable(chatml: ChatTemplate) -> None:
    first = chatml.render([USER])
    assert all(chatml.render([USER]) == first for _ in range(100))


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.__class__.__base__ }}",
        "{% set x = messages.append(1) %}",
        "{% set _ = messages[0].update({'role': 'x'}) %}",
        "{{ '{0.__class__.__mro__}'.format(1) }}",
    ],
)
def test_sandbox_blocks_escapes(source: str) -> None:
    messages = [dict(USER)]
    with pytest.raises(InvalidArgument, match="/models/evil") as info:
        render(source, messages)
    assert "sandbox" in info.value.message or "unsafe" in info.value.message
    assert messages == [USER]  # nothing was mutated


def test_raise_exception_carries_the_template_message() -> None:
    source = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('Conversation must start with system') }}"
        "{% endif %}"
    )
    with pytest.raises(InvalidArgument) as info:
        render(source)
    assert info.value.message == "Conversation must start with system"


def test_syntax_error_names_the_model_folder() -> None:
    with pytest.raises(InvalidArgument, match=r"chat template of /models/broken does not compile \(line 2"):
        ChatTemplate("ok\n{% for m in messages %}", origin="/models/broken")


def test_render_error_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="cannot render these messages"):
        render("{{ messages[0]['content'] + 1 }}")


def test_tojson_keeps_non_ascii() -> None:
    out = render("{{ messages | tojson }}", [{"role": "user", "content": "日本語 🙂"}])
    assert out == '[{"role": "user", "content": "日本語 🙂"}]'
    assert render("{{ messages[0] | tojson(indent=2) }}").startswith('{\n  "role"')


def test_strftime_now() -> None:
    year = render("{{ strftime_now('%Y') }}")
    assert year in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}


def test_trim_and_lstrip_blocks() -> None:
    source = "{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}\n"
    assert render(source) == "user\n"


def test_variables_and_extras() -> None:
    template = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ enable_thinking | default('x') }}",
        variables={"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert template.render([USER]) == "<s>|</s>|True|x"
    assert template.render([USER], enable_thinking=False, eos_token="E") == "<s>|E|True|False"


def test_loop_controls_and_generation_block() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.role }}]{% endgeneration %}{% endfor %}"
    )
    assert render(source, [USER, USER]) == "[user]"
