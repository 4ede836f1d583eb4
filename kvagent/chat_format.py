"""A model's chat template reduced to per-role wrappers (open and closing tags).

kvagent renders each segment as one message on its own (see ``segments.py``), so it needs, for every
role, the text the template writes before and after a message's content. We obtain them from the
model's own Jinja template (GGUF key ``tokenizer.chat_template``) by rendering sentinel conversations
and cutting around the sentinels, the way the template itself would format them.

Decisions, stated once: the template's default system prompt (SmolLM2 adds one when a conversation
has none) is not rendered, since kvagent's policy segments are the system prompt; templates that have
no system role (Gemma 3 folds it into the first user turn) get system segments wrapped as user
messages; an assistant message opens with the template's generation prompt, so a generated turn and
its later re-rendering are the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvagent.errors import ChatTemplateError

_U1, _U2, _A1, _A2, _S = "KVAU1X", "KVAU2X", "KVAA1X", "KVAA2X", "KVASYSX"


@dataclass(frozen=True)
class RoleWrap:
    """Text written before (``open``) and after (``close``) a message of one role."""

    open: str
    close: str


@dataclass(frozen=True)
class ChatFormat:
    """Role wrappers and the generation prompt of one chat template; ``eos_token``: the text the template was
    rendered with for ``eos_token`` (the model's end-of-sequence token, which Mistral's templates write after each
    assistant turn; kvagent tokenizes wrappers with special tokens, so it becomes that token)."""

    name: str
    system: RoleWrap
    user: RoleWrap
    assistant: RoleWrap
    generation_prompt: str
    eos_token: str = ""

    def wrap(self, role: str) -> RoleWrap:
        try:
            return {"system": self.system, "user": self.user, "assistant": self.assistant}[role]
        except KeyError:
            raise ChatTemplateError(f"unknown role {role!r}: use system, user or assistant") from None

    @classmethod
    def plain(cls) -> ChatFormat:
        """No template: each segment is its text followed by a newline (base models, raw prompts)."""
        line = RoleWrap("", "\n")
        return cls("plain", line, line, line, "")

    @classmethod
    def from_template(cls, template: str, name: str = "model", eos_token: str = "") -> ChatFormat:
        """Derive the wrappers from a Jinja chat template (rendered with ``eos_token``, the model's EOS text);
        :class:`ChatTemplateError` if it cannot."""
        render = _compile(template, eos_token)

        def conv(*pairs: tuple[str, str], gen: bool = False) -> str:
            return render([{"role": r, "content": c} for r, c in pairs], gen)

        try:
            one = conv(("user", _U1))
            gen_prompt = _after(conv(("user", _U1), gen=True), one)
            full = conv(("user", _U1), ("assistant", _A1), ("user", _U2), ("assistant", _A2))
            # read off the first exchange: a template may open the last assistant turn with more (Qwen3's empty
            # think block), which a prompt kvagent extends never has there
            first = _between(full, _U1, _A1)
            user_close = first.removesuffix(gen_prompt)
            asst_close = full[full.index(_A2) + len(_A2) :]
            user_open = _between(full, _A1, _U2).removeprefix(asst_close)
            # an empty generation prompt is a template whose assistant turn opens right after the user's close
            # (Mistral's ``[INST]...[/INST]``)
            if not (gen_prompt or user_close) or not first.endswith(gen_prompt) or \
                    not _between(full, _U2, _A2).startswith(first):
                raise ChatTemplateError(f"the chat template of {name} does not wrap turns uniformly")
            with_sys = conv(("system", _S), ("user", _U1), ("assistant", _A1))
            # a template may move the system text into the last user message (Mistral-Nemo), or drop it
            sys_to_user = _between(with_sys, _S, _U1) if _S in with_sys else ""
            if sys_to_user.endswith(user_open) and user_open:
                sys_close = sys_to_user.removesuffix(user_open)
                sys_open = with_sys[: with_sys.index(_S)]
                system = RoleWrap(sys_open, sys_close)
            else:  # no system role of its own in this template: a system segment becomes a user message
                system = RoleWrap(user_open, user_close)
            # the wrappers must write a conversation as the template does (after any default system text)
            turns = (f"{user_open}{_U1}{user_close}{gen_prompt}{_A1}{asst_close}"
                     f"{user_open}{_U2}{user_close}{gen_prompt}")
            if not conv(("user", _U1), ("assistant", _A1), ("user", _U2), gen=True).endswith(turns) or (
                    system.open != user_open and conv(("system", _S), ("user", _U1), ("assistant", _A1),
                                                      ("user", _U2), gen=True) != system.open + _S + system.close + turns):
                raise ChatTemplateError(f"the chat template of {name} does not write turns as kvagent reads them; "
                                        "open the session with chat=False to use plain text")
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja errors, missing sentinels: the template is not one we can split
            raise ChatTemplateError(
                f"cannot derive role wrappers from the chat template of {name} ({exc}); "
                "open the session with chat=False to use plain text"
            ) from exc
        return cls(name, system, RoleWrap(user_open, user_close), RoleWrap(gen_prompt, asst_close), gen_prompt,
                   eos_token)


# Formats for models whose GGUF carries no chat template (the Gemma 3 270M we ship has none), by
# GGUF architecture: the family's documented turn format, as llama.cpp's built-in "gemma" template.
_GEMMA_USER = RoleWrap("<start_of_turn>user\n", "<end_of_turn>\n")
BUILTIN_FORMATS: dict[str, ChatFormat] = {
    "gemma3": ChatFormat(
        "gemma (built-in)", _GEMMA_USER, _GEMMA_USER, RoleWrap("<start_of_turn>model\n", "<end_of_turn>\n"),
        "<start_of_turn>model\n",
    ),
}


def compile_template(source: str) -> Any:
    """A chat template compiled in the one environment kvagent renders templates in, as Hugging Face's
    ``transformers`` renders them: sandboxed (immutable), ``trim_blocks`` and ``lstrip_blocks``, the
    ``loopcontrols`` extension, ``tojson`` as ``json.dumps`` (not Jinja's HTML-escaping one), and the globals
    templates call (``raise_exception``, ``strftime_now``). Returns a ``jinja2.Template``; render it with
    ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` (and ``tools`` where it takes them)."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _compile(template: str, eos_token: str = "") -> Any:
    compiled = compile_template(template)

    def render(messages: list[dict[str, str]], gen: bool) -> str:
        # BOS is added by the tokenizer, never as template text.
        return str(compiled.render(messages=messages, add_generation_prompt=gen, bos_token="", eos_token=eos_token))

    return render


def _after(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise ChatTemplateError("the generation prompt is not appended after the conversation")
    return text[len(prefix) :]


def _between(text: str, left: str, right: str) -> str:
    start = text.index(left) + len(left)
    return text[start : text.index(right, start)]
