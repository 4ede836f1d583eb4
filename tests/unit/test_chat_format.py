"""Deriving role wrappers from real chat templates."""

from __future__ import annotations

import pytest

from kvagent.chat_format import BUILTIN_FORMATS, ChatFormat, RoleWrap
from kvagent.errors import ChatTemplateError

# SmolLM2-135M-Instruct's template, as stored in its GGUF (adds a default system prompt)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's published template: no system role (folded into the first user turn), assistant -> model
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}"
    "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "system", "user", "assistant"),
    [
        (SMOLLM2, RoleWrap("<|im_start|>system\n", "<|im_end|>\n"), RoleWrap("<|im_start|>user\n", "<|im_end|>\n"),
         RoleWrap("<|im_start|>assistant\n", "<|im_end|>\n")),
        (GEMMA, RoleWrap("<start_of_turn>user\n", "<end_of_turn>\n"), RoleWrap("<start_of_turn>user\n", "<end_of_turn>\n"),
         RoleWrap("<start_of_turn>model\n", "<end_of_turn>\n")),
    ],
)
def test_wrappers_from_template(template: str, system: RoleWrap, user: RoleWrap, assistant: RoleWrap) -> None:
    fmt = ChatFormat.from_template(template)
    assert (fmt.system, fmt.user, fmt.assistant) == (system, user, assistant)
    assert fmt.generation_prompt == assistant.open


def test_builtin_gemma_matches_its_published_template() -> None:
    derived = ChatFormat.from_template(GEMMA)
    builtin = BUILTIN_FORMATS["gemma3"]
    assert (derived.system, derived.user, derived.assistant) == (builtin.system, builtin.user, builtin.assistant)


@pytest.mark.parametrize("template", ["{{ raise_exception('no') }}", "{% for m in messages %}{{ m['content'] }}{% endfor %}"])
def test_unsplittable_template_is_a_clear_error(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="chat=False|uniformly|generation prompt"):
        ChatFormat.from_template(template)


def test_unknown_role() -> None:
    with pytest.raises(ChatTemplateError, match="unknown role 'tool'"):
        ChatFormat.plain().wrap("tool")
