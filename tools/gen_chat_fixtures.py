#!/usr/bin/env python3
"""Render the real chat templates in tests/data/chat_templates/*.jinja with Jinja2, configured the
way Hugging Face's apply_chat_template configures it (trim_blocks, lstrip_blocks, raise_exception),
and write the expected strings to tests/data/chat_templates/expected.json.

Templates: smollm2.jinja is SmolLM2-135M-Instruct's `tokenizer.chat_template`; gemma3.jinja is
Gemma 3's tokenizer_config.json template (the Gemma 3 270M GGUF carries none); the others are the
published templates of OpenHermes (ChatML), Llama 2 chat, Llama 3 instruct, Mistral 7B instruct
v0.1/v0.2, Phi-3, Zephyr, Phi-4, Phi-4-mini, gpt-oss (openai/gpt-oss-120b's harmony template,
whose strftime_now date is fixed here as FIXED_DATE and stored with its cases) and Granite
(ibm-granite/granite-3.3-2b-instruct's, whose default system prompt states the date as
strftime_now('%B %d, %Y') writes FIXED_DATE) and SmolLM3 (HuggingFaceTB/SmolLM3-3B's, its
"Today Date" strftime_now('%d %B %Y'); its {% generation %} markers, which render nothing, left
out), rendered with enable_thinking false as Baton renders it by default (/no_think), and with
system messages that switch the mode (/think, /no_think) or replace the metadata
(/system_override). olmo2.jinja is allenai/OLMo-2-1124-13B-Instruct's tokenizer_config.json
template (Tülu 3's turns).
Run: python3 tools/gen_chat_fixtures.py  (needs jinja2)
"""
import datetime
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "chat_templates")

TOKENS = {  # bos_token, eos_token as each model's tokenizer defines them
    "smollm2": ("<|im_start|>", "<|im_end|>"),
    "chatml": ("<s>", "<|im_end|>"),
    "gemma3": ("<bos>", "<eos>"),
    "llama2": ("<s>", "</s>"),
    "llama3": ("<|begin_of_text|>", "<|end_of_text|>"),
    "mistral": ("<s>", "</s>"),
    "phi3": ("<s>", "<|endoftext|>"),
    "zephyr": ("<s>", "</s>"),
    "phi4": ("<|endoftext|>", "<|im_end|>"),
    "phi4mini": ("<|endoftext|>", "<|endoftext|>"),
    "gpt-oss": ("<|startoftext|>", "<|return|>"),
    "granite": ("<|end_of_text|>", "<|end_of_text|>"),
    "smollm3": ("<|begin_of_text|>", "<|im_end|>"),
    "olmo2": ("<|endoftext|>", "<|endoftext|>"),
}
RENDER_VARS = {  # what a template is rendered with besides the conversation
    "smollm3": {"enable_thinking": False},
}
FIXED_DATE = "2025-08-05"  # what strftime_now("%Y-%m-%d") returns in the fixtures

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TWO_TURNS = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi there. How can I help?"},
    {"role": "user", "content": "  What is the capital of France?  "},
]
CASES = [
    ([SYSTEM] + TWO_TURNS, True),
    ([SYSTEM] + TWO_TURNS[:2], False),   # history after a reply, as a chat REPL holds it
    (TWO_TURNS, True),
    (TWO_TURNS[:1], True),
    ([SYSTEM] + TWO_TURNS[:1], True),
]
# gpt-oss: an earlier reply's reasoning ("thinking") is not rendered; only its final answer is.
EXTRA_CASES = {
    "gpt-oss": [
        ([SYSTEM, TWO_TURNS[0], dict(TWO_TURNS[1], thinking="The user greets me. Greet back."), TWO_TURNS[2]], True),
    ],
    "smollm3": [
        ([{"role": "system", "content": "/think"}] + TWO_TURNS, True),
        ([{"role": "system", "content": "Answer briefly. /think  "}] + TWO_TURNS[:2], False),
        ([{"role": "system", "content": "Be terse. /no_think /think"}] + TWO_TURNS[:1], True),
        ([{"role": "system", "content": "You are Smol. /system_override \n"}] + TWO_TURNS, True),
        ([{"role": "system", "content": "/think"}, TWO_TURNS[0], dict(TWO_TURNS[1], content="\n\nHi.\n")], False),
    ],
}


class TemplateError(Exception):
    pass


def raise_exception(msg):
    raise TemplateError(msg)


def render(src, bos, eos, messages, gen, extra={}):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    fixed = datetime.date.fromisoformat(FIXED_DATE)
    env.globals["strftime_now"] = lambda fmt: (fixed.strftime(fmt) if fmt in ("%Y-%m-%d", "%B %d, %Y", "%d %B %Y")
                                               else raise_exception(fmt))
    return env.from_string(src).render(messages=messages, add_generation_prompt=gen, bos_token=bos, eos_token=eos,
                                       **extra)


def main():
    out = {}
    for name, (bos, eos) in TOKENS.items():
        src = open(os.path.join(DIR, name + ".jinja")).read()
        cases = []
        for messages, gen in CASES + EXTRA_CASES.get(name, []):
            try:
                expected = render(src, bos, eos, messages, gen, RENDER_VARS.get(name, {}))
            except TemplateError as e:
                expected = None  # the template refuses this conversation (e.g. no system role)
                print(name, "refuses:", e)
            cases.append({"messages": messages, "add_generation_prompt": gen, "expected": expected})
        out[name] = {"bos_token": bos, "eos_token": eos, "cases": cases}
        if "strftime_now" in src:
            out[name]["date"] = FIXED_DATE
    with open(os.path.join(DIR, "expected.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=True)
    print("wrote", os.path.join(DIR, "expected.json"))


if __name__ == "__main__":
    main()
