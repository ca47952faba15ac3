"""Chat prompts rendered by tokenmill against transformers' ``apply_chat_template`` given the
conversation as vLLM prepares it (vllm/entrypoints/chat_utils.py: contents in the template's format,
tool-call arguments as objects, tool results as strings...), for real-world template shapes written
from their public formats: SmolLM2's own (from its converted folder), Llama-3.1 with tools, Qwen2.5
with tools, Qwen3 with <think> and enable_thinking, Mistral (raises on non-alternating roles), Phi-3,
and templates that loop over content parts. Token ids and text must be transformers' own."""

from __future__ import annotations

import json

import pytest

from support.tiny_models import build_tiny_tokenizer
from tokenmill.inputs import render_chat_prompt

LLAMA3 = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}"""

PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")

# Loops over a message's parts (Llama-4 / Mistral-Small style): vLLM's "auto" picks "openai" for it.
PARTS = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n{%- if message.content is string %}"
         "{{ message.content }}{%- else %}{%- for part in message.content %}[{{ part.type }}]{{ part.text }}"
         "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

# Retrieval-augmented templates (Command-R, Granite) read apply_chat_template's ``documents``.
DOCUMENTS = ("{%- if documents %}<docs>{%- for d in documents %}[{{ d.title }}] {{ d.text }}\n{%- endfor %}</docs>{%- endif %}"
             "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
             "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
TOOL_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"}]
PLAIN = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi, naïve café 東京 🙂"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


def vllm_conversation(messages: list[dict], content_format: str) -> list[dict]:
    """The conversation as vLLM's parse_chat_messages hands it to the template (text-only parts):
    role and content (parts joined with newlines, empty texts left out, for "string"; text parts for
    "openai"; a tool's text parts joined either way), an assistant's tool_calls (arguments parsed from
    JSON, an empty list dropped) and reasoning, a tool's tool_call_id, a string name."""
    out = []
    for message in messages:
        content = message.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts = [p if isinstance(p, str) else p.get("thinking") if p.get("type") == "thinking" else p.get("text", p.get("refusal"))
                 for p in parts]
        texts = [t for t in texts if t is not None]
        new: dict = {"role": message["role"]}
        if content_format == "openai":
            new["content"] = [{"type": "text", "text": t} for t in texts]
            if message["role"] == "tool":
                new["content"] = "\n".join(texts)
        else:
            new["content"] = "\n".join(t for t in texts if t)
        if message["role"] == "assistant":
            if message.get("tool_calls") is not None:
                calls = json.loads(json.dumps(message["tool_calls"]))
                for call in calls:
                    arguments = call["function"].get("arguments")
                    if isinstance(arguments, str) and arguments:
                        call["function"]["arguments"] = json.loads(arguments)
                    elif not isinstance(arguments, (dict, list)):
                        call["function"]["arguments"] = {}
                if calls:
                    new["tool_calls"] = calls
            if message.get("reasoning") is not None:
                new["reasoning"] = new["reasoning_content"] = message["reasoning"]
        if message["role"] == "tool" and "tool_call_id" in message:
            new["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            new["name"] = message["name"]
        out.append(new)
    return out


def reference(tokenizer, messages, template, content_format="string", **options) -> tuple[list[int], str]:
    """transformers' token ids and text for the conversation as vLLM prepares it."""
    conversation = vllm_conversation(messages, content_format)
    options.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **options)
    ids = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=True, return_dict=False, **options)
    assert ids == tokenizer.encode(text, add_special_tokens=False)  # what vLLM encodes the rendered text to
    return ids, text


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The tiny tokenizer adding BOS to every encode (as Llama's does)."""
    from tokenizers import processors

    tokenizer = build_tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_source.tokenizer_path)


def check(tokenizer, messages, template, content_format="auto", expected_format="string", **options):
    ids, text = reference(tokenizer, messages, template, expected_format, **options)
    got = render_chat_prompt(tokenizer, messages, chat_template=template, content_format=content_format,
                             add_generation_prompt=options.pop("add_generation_prompt", True),
                             continue_final_message=options.pop("continue_final_message", False),
                             tools=options.pop("tools", None), chat_template_kwargs=options or None)
    assert got == ids
    assert tokenizer.decode(got) == text
    return text


@pytest.mark.parametrize("name", ["llama3", "qwen25", "qwen3", "mistral", "phi3", "tiny"])
@pytest.mark.parametrize("generation", [True, False])
def test_plain_conversations_render_as_transformers_does(tiny, bos_tokenizer, name, generation):
    template = {"llama3": LLAMA3, "qwen25": QWEN25, "qwen3": QWEN3, "mistral": MISTRAL, "phi3": PHI3,
                "tiny": tiny.chat_template}[name]
    text = check(tiny, PLAIN, template, add_generation_prompt=generation)
    assert "naïve café 東京 🙂" in text
    if "bos_token" in template:  # a template that emits BOS gets no second one from tokenization
        ids = render_chat_prompt(bos_tokenizer, PLAIN, chat_template=template, add_generation_prompt=generation)
        assert ids.count(bos_tokenizer.bos_token_id) == 1 and ids[0] == bos_tokenizer.bos_token_id


def test_smollm2s_own_template(smollm2):
    for messages in (PLAIN, PLAIN[1:], [{"role": "user", "content": ""}]):
        for generation in (True, False):
            check(smollm2, messages, None, add_generation_prompt=generation)
    text = check(smollm2, PLAIN[:3], None, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello.")
    assert render_chat_prompt(smollm2, PLAIN)[0] == smollm2.convert_tokens_to_ids("<|im_start|>")  # no BOS added


def test_continue_final_message(tiny):
    prefill = PLAIN[:3] + [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "The answer is"}]
    for template in (LLAMA3, QWEN25, MISTRAL, PHI3):
        text = check(tiny, prefill, template, add_generation_prompt=False, continue_final_message=True)
        assert text.endswith("The answer is")


@pytest.mark.parametrize("template", [LLAMA3, QWEN25, QWEN3])
def test_tools_and_tool_call_histories(tiny, template):
    check(tiny, TOOL_TURN[:2], template, tools=TOOLS)
    check(tiny, TOOL_TURN, template, tools=TOOLS)
    as_dict = [*TOOL_TURN[:2], {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]}, TOOL_TURN[3]]
    assert (render_chat_prompt(tiny, as_dict, chat_template=template, tools=TOOLS)
            == render_chat_prompt(tiny, TOOL_TURN, chat_template=template, tools=TOOLS))


def test_qwen3_thinking(tiny):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "3+3?"}]
    assert check(tiny, messages, QWEN3).endswith("<|im_start|>assistant\n")
    assert check(tiny, messages, QWEN3, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    check(tiny, messages, QWEN3, enable_thinking=True)


def test_content_parts_in_each_format(tiny):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a cat"}, "sat", {"type": "input_text", "text": "on"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "mat"}, {"type": "refusal", "refusal": "no"}]}]
    assert "a cat\nsat\non" in check(tiny, parts, QWEN25, "auto", "string")
    check(tiny, parts, QWEN25, "string", "string")
    assert "[text]a cat[text]sat[text]on" in check(tiny, parts, PARTS, "auto", "openai")
    check(tiny, parts, PARTS, "openai", "openai")
    check(tiny, parts, PARTS, "string", "string")


def test_mistral_refuses_non_alternating_roles_naming_the_conversation(tiny):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match=r"^messages: the chat template refused it: TemplateError: After the optional "
                                         r"system message, conversation roles must alternate"):
        render_chat_prompt(tiny, bad, chat_template=MISTRAL)
    from tokenmill.inputs import render_chat_prompts

    with pytest.raises(ValueError, match=r"^messages\[1\]: the chat template refused it: TemplateError: After"):
        render_chat_prompts(tiny, [PLAIN[1:2], bad, PLAIN[1:2]], MISTRAL, True, False, None,
                            ["messages[0]", "messages[1]", "messages[2]"])


def test_unknown_part_types_are_refused_naming_field_value_and_allowed(tiny):
    image = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\] has type 'image_url'.*one of \['input_text', "):
        render_chat_prompt(tiny, image, chat_template=QWEN25)


def test_documents_through_chat_template_kwargs(tiny):
    documents = [{"title": "Rivers", "text": "The Rhine flows north."}, {"title": "Städte", "text": "Zürich"}]
    assert "<docs>[Rivers]" in check(tiny, PLAIN[1:2], DOCUMENTS, documents=documents)


def test_name_fields_empty_and_none_contents(tiny):
    named = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": None},
             {"role": "user", "content": ""}]
    template = ("{%- for m in messages %}<|im_start|>{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}\n"
                "{{ m.content }}<|im_end|>\n{%- endfor %}")
    assert "<|im_start|>user:annhi" in check(tiny, named, template)  # trim_blocks eats the newline
    check(tiny, named, PARTS, "auto", "openai")


# Renders a message's content through a macro whose loop reads a variable named ``content``
# (Qwen3.5's shape): vLLM's "auto" detection counts that loop (vllm-project/vllm#42660).
MACRO_PARTS = ("{%- macro render(content) %}{%- if content is string %}{{ content }}{%- else %}"
               "{%- for item in content %}[{{ item.type }}]{{ item.text }}{%- endfor %}{%- endif %}{%- endmacro %}"
               "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ render(m.content) }}<|im_end|>\n{%- endfor %}"
               "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_parts_vllm_skips_joins_or_reads_as_text(tiny):
    """vLLM leaves out a text part without text, and (joining for "string") an empty one; a
    "thinking" part is text; a tool's text parts reach the template joined even under "openai"."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "thinking", "thinking": "hmm"},
             {"type": "text"}, {"type": "refusal", "refusal": None}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    assert "user\na\nhmm\nb<|im_end|>" in check(tiny, messages, QWEN25, "auto", "string")
    assert "[text]a[text][text]hmm[text]b" in check(tiny, messages, PARTS, "auto", "openai")
    tool = [*TOOL_TURN[:3], {"role": "tool", "tool_call_id": "call_1",
                             "content": [{"type": "text", "text": "21"}, {"type": "text", "text": "sunny"}]}]
    assert "ipython<|end_header_id|>\n\n21\nsunny<|eot_id|>" in check(tiny, tool, LLAMA3, "openai", "openai", tools=TOOLS)
    assert "<|im_start|>tool21\nsunny<|im_end|>" in check(tiny, tool, PARTS, "auto", "openai")


def test_macro_loop_over_content_is_the_openai_format(tiny):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\n[text]a[text]b<|im_end|>" in check(tiny, messages, MACRO_PARTS, "auto", "openai")


def test_tool_call_histories_as_vllm_repairs_them(tiny):
    """An empty tool_calls list is dropped (Llama 3.1's template tests its presence and raises);
    arguments that are no JSON, or of another type, are refused naming the call (vLLM's json.loads
    fails on them too)."""
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello.", "tool_calls": []},
             {"role": "user", "content": "bye"}]
    assert "assistant<|end_header_id|>\n\nHello.<|eot_id|>" in check(tiny, empty, LLAMA3)
    for arguments, why in (('{"city": "Zür', "must be JSON"), (5, "must be a JSON string or an object, got int")):
        broken = [*TOOL_TURN[:2], {"role": "assistant", "content": None, "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": arguments}}]}]
        with pytest.raises(ValueError, match=rf"\[2\]\.tool_calls\[0\]\.function\.arguments {why}"):
            render_chat_prompt(tiny, broken, chat_template=LLAMA3, tools=TOOLS)
    assert TOOL_TURN[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'  # not mutated


def test_assistant_reasoning_reaches_the_template_as_reasoning_content(tiny):
    """vLLM passes an assistant's ``reasoning`` as both ``reasoning`` and ``reasoning_content``
    (the name Qwen3's and DeepSeek's templates read)."""
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "add them"},
                {"role": "user", "content": "3+3?"}]
    assert "<think>\nadd them\n</think>\n\n4" in check(tiny, messages, QWEN3)
