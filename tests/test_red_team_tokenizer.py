# ruff: noqa: E501 (the real chat templates below are kept as their models ship them)
"""An artifact's tokenizer is someone else's: its config names no file for transformers to open (a
tokenizer from outside the artifact, any host file), no hf/ file is larger than a tokenizer file, its
chat template computes nothing whose cost a number sets (jinja runs that in C, past any time bound),
and its regexes neither backtrack for hours nor end a run in a Rust panic's traceback."""

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from conftest import make_model, rehash_artifact
from pact.convert import convert
from pact.formats import ArtifactError, PactError, open_artifact
from pact.formats.files import JSON_MAX
from pact.runtime import data
from pact.runtime.session import load_tokenizer, regex_hazard


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    make_model(d / "src", "llama")
    convert(str(d / "src"), d / "art", progress=False)
    return d


def _copy(base, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(base / "art", art, symlinks=True)
    return art


def _edit_json(path, **changes):
    """Edit (or add) an hf/ JSON file, its checksum re-recorded (a new file listed), as a crafted artifact would."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**doc, **changes}))
    rehash_artifact(path.parent.parent)


def _outside_tokenizer(art, tmp_path):
    """A copy of the artifact's tokenizer.json outside it, with a token the artifact's own does not have."""
    tj = json.loads((art / "hf" / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": len(tj["model"]["vocab"]) + 10, "content": "OUTSIDE", "single_word": False,
                               "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "victim").mkdir()
    out = tmp_path / "victim" / "tokenizer.1.0.json"
    out.write_text(json.dumps(tj))
    return out


# ---- no file named for the tokenizer to open


@pytest.mark.parametrize("file,key,value,reported", [
    ("tokenizer_config.json", "fast_tokenizer_files", ["../../victim/tokenizer.1.0.json"], "fast_tokenizer_files"),
    ("tokenizer_config.json", "fast_tokenizer_files", ["tokenizer.1.json.d/" + "../" * 12 + "etc/passwd"],
     "fast_tokenizer_files"),
    ("tokenizer_config.json", "merges_file", "/etc/passwd", "merges_file"),
    ("tokenizer_config.json", "gguf_file", "/tmp/model.gguf", "gguf_file"),
    ("tokenizer_config.json", "vocab", "/etc/passwd", "vocab"),
    ("tokenizer_config.json", "sp_model_kwargs", {"model_file": "/dev/zero"}, "model_file"),
    # merged into the tokenizer's arguments after transformers' own files: it is opened as written
    ("special_tokens_map.json", "tokenizer_file", "/tmp/victim/tokenizer.1.0.json", "tokenizer_file"),
])
def test_a_config_naming_a_file_is_refused(base, tmp_path, file, key, value, reported):
    art = _copy(base, tmp_path)
    _edit_json(art / "hf" / file, **{key: value})
    with pytest.raises(ArtifactError, match=rf"hf/{file}: '{reported}' names a file for the tokenizer to open: "
                                            r"refusing it .*re-run pact-convert from a source without the key"):
        open_artifact(art)


def test_before_the_check_an_outside_tokenizer_was_read(base, tmp_path):
    """What the check stops (the red team's repro): transformers joins fast_tokenizer_files onto hf/ as written."""
    from transformers import AutoTokenizer

    art = _copy(base, tmp_path)
    _outside_tokenizer(art, tmp_path)  # in tmp_path/victim/: two folders above hf/
    _edit_json(art / "hf" / "tokenizer_config.json", fast_tokenizer_files=["../../victim/tokenizer.1.0.json"])
    assert "OUTSIDE" in AutoTokenizer.from_pretrained(art / "hf").get_vocab()
    with pytest.raises(ArtifactError, match="'fast_tokenizer_files' names a file"):
        open_artifact(art)


def test_file_keys_transformers_replaces_are_accepted_and_ignored(base, tmp_path):
    """Old saves hold absolute tokenizer_file / special_tokens_map_file paths in tokenizer_config.json:
    transformers replaces them with the folder's own files, so they open, and the outside file is never read."""
    art = _copy(base, tmp_path)
    outside = _outside_tokenizer(art, tmp_path)
    _edit_json(art / "hf" / "tokenizer_config.json", tokenizer_file=str(outside), special_tokens_map_file=str(outside),
               vocab_file=None)
    _edit_json(art / "hf" / "special_tokens_map.json", eos_token="<|im_end|>")
    tok = load_tokenizer(open_artifact(art))
    assert "OUTSIDE" not in tok.get_vocab() and tok.eos_token == "<|im_end|>"


# ---- every hf/ file bounded


@pytest.mark.parametrize("rel", ["chat_template.jinja", "merges.txt", "tokenizer.model",
                                 "additional_chat_templates/tools.jinja"])
def test_an_oversized_hf_file_is_refused(base, tmp_path, rel):
    art = _copy(base, tmp_path)
    f = art / "hf" / rel
    f.parent.mkdir(exist_ok=True)
    with open(f, "ab") as fh:  # sparse: costs the sender nothing, transformers reads it whole
        fh.truncate(JSON_MAX + 1)
    with pytest.raises(ArtifactError, match=rf"hf/{rel}: {JSON_MAX + 1} bytes, more than the {JSON_MAX} bytes a "
                                            r"config, tokenizer or chat template file may hold \(transformers reads "
                                            r"it whole\): .*re-copy it or re-run pact-convert"):
        open_artifact(art)
    with open(f, "r+b") as fh:
        fh.truncate(JSON_MAX)
    rehash_artifact(art)
    open_artifact(art)  # the bound itself is allowed


# ---- chat templates: nothing whose cost a number sets


@pytest.mark.parametrize("template,why", [
    ("{% set x = 7 ** 777777777 %}{{ messages[0]['content'] }}", r"raises to a power \(\*\*\) on line 1"),
    ("{% for m in messages %}\n{{ m['content'] * m['content']|length }}{% endfor %}",
     r"multiplies by a computed count or one over 1024 \(\*\) on line 2"),
    ("{{ 'a very long written string' * n }}", "multiplies by a computed count"),
    ("{{ 'a' * 1000000000 }}", "multiplies by a computed count or one over 1024"),
    ("{% set ns = namespace(n=10) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "multiplies by a computed count"),
    ("{{ 5|round(-100000000) }}", "calls round with a computed precision"),
    ("{{ 5|round(2, 'floor')|round(precision=n) }}", "calls round with a computed precision"),
    ("{{ [[0]]|sum(start=[]) }}", "calls sum with a computed start"),
    ("{{ xs|map('sum', 'a', []) }}", "calls sum with a computed start"),
    ("{{ xs|map('sum', attribute='a', start=[]) }}", "calls sum with a computed start"),
    ("{{ xs|map('map', 'round', n) }}", "calls round with a computed precision"),
    ("{{ xs|map(name) }}", "maps a computed filter"),
    ("{{ x|round(*args) }}", "calls round with unpacked arguments"),
    ("{% filter round(n) %}5{% endfilter %}", "calls round with a computed precision"),
    ("{% generation %}{{ 2 ** 99999999 }}{% endgeneration %}", r"raises to a power"),
])
def test_template_hazards_are_named(template, why):
    hazard = data.template_hazard(template)
    assert re.match(why, hazard) and hazard.endswith(": jinja computes it in C, where no time bound can stop it")


def test_an_oversized_template_is_refused():
    assert data.template_hazard("x" * (data.TEMPLATE_CHARS + 1)) == \
        f"is {data.TEMPLATE_CHARS + 1} characters (bound {data.TEMPLATE_CHARS})"


@pytest.mark.parametrize("template", [
    "{{ '-' * 80 }}{{ 3 * loop_count }}{{ x * 2.5 }}", "{% for m in messages %}{{ loop.index0 % 2 }}{% endfor %}",
    "{%- set offset = '    ' * depth -%}{{ offset }}{{ '  ' * loop_depth0 }}",  # tool templates indent by depth
    "{{ x|round }}{{ x|round(2) }}{{ x|round(1, 'ceil') }}",
    "{{ xs|sum }}{{ xs|sum('n') }}{{ xs|sum(attribute='n', start=1) }}",
    "{{ messages|map(attribute='role')|join(', ') }}{{ xs|map('trim')|list }}{{ xs|map('round', 2)|list }}",
])
def test_ordinary_template_arithmetic_is_allowed(template):
    assert data.template_hazard(template) is None


LLAMA_3_1 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
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
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
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
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN_2_5 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SMOLLM2 = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""

GEMMA_3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

MISTRAL_V3 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

TAGGED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok(base):
    return load_tokenizer(open_artifact(base / "art"))


@pytest.mark.parametrize("name,template", [
    ("llama-3.1", LLAMA_3_1), ("qwen-2.5", QWEN_2_5), ("smollm2", SMOLLM2), ("gemma-3", GEMMA_3),
    ("mistral-v0.3", MISTRAL_V3), ("generation-tags", TAGGED), ("tests' own", None),
])
def test_real_chat_templates_render(tok, monkeypatch, name, template):
    from conftest import VL_TEMPLATE

    for src in ([template] if template else [tok.chat_template, VL_TEMPLATE]):
        assert data.template_hazard(src) is None, name
        monkeypatch.setattr(tok, "chat_template", src)
        text = data.render_chat(tok, [{"role": "user", "content": "the movie"},
                                      {"role": "assistant", "content": "was fresh"}], "x")
        assert "the movie" in text and "was fresh" in text


def test_a_hostile_template_is_refused_before_jinja_compiles_it(base, tmp_path):
    """The red team's repro (minutes in C before): one error, at once, from training's tokenization."""
    art = _copy(base, tmp_path)
    (art / "hf" / "chat_template.jinja").write_text(
        "{% set x = 7 ** 777777777 %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rehash_artifact(art)
    tok = load_tokenizer(open_artifact(art))  # prompt/completion records never render it
    assert data.tokenize([{"prompt": "the movie", "completion": " fresh", "_where": "d.jsonl:1"}], tok, max_len=64)
    t = time.monotonic()
    with pytest.raises(PactError, match=r"^chat.jsonl:1: the chat template raises to a power \(\*\*\) on line 1: "
                                        r"jinja computes it in C, where no time bound can stop it: the artifact's "
                                        r"chat template .* is faulty or hostile"):
        data.tokenize([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                        "_where": "chat.jsonl:1"}], tok, max_len=64)
    assert time.monotonic() - t < 5


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="the memory bound is Linux's RLIMIT_AS")
@pytest.mark.parametrize("template", [
    "{{ 'x'|center(3000000000) }}", "{{ 'x'.zfill(3000000000) }}", "{{ [[1]]|tojson(indent=200000000) }}",
    "{{ '%3000000000d'|format(1) }}", "{{ '{:>3000000000}'.format(1) }}",
    "{% set a = 'x'|center(1000) %}{{ a.replace('', a).replace('', a) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
])
def test_a_template_that_allocates_in_c_is_stopped(tok, monkeypatch, template):
    """What no time bound reaches (jinja runs a filter or method in C: 3e9 characters at once) nor template_hazard
    names (a width, an indent, a replace, a doubling loop): the rendering's address space is bounded
    (TEMPLATE_BYTES), so the allocation fails at once and the run gets one error; the process's own limit is back
    after."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)
    assert data.template_hazard(template) is None  # (the static check does not see these)
    monkeypatch.setattr(tok, "chat_template", template)
    t = time.monotonic()
    with pytest.raises(PactError, match=r"^x: (rendering the chat template needed over 256 MiB of memory|the chat "
                                        r"template rendered \d+ characters \(bound \d+\)): the artifact's chat "
                                        r"template .* is faulty or hostile"):
        data.render_chat(tok, [{"role": "user", "content": "hi"}], "x")
    assert time.monotonic() - t < 5
    assert resource.getrlimit(resource.RLIMIT_AS) == limit
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert data.render_chat(tok, [{"role": "user", "content": "hi"}], "x") == "hi"  # and the next one renders


def test_many_or_huge_templates_are_refused_and_checks_run_once(tok, monkeypatch):
    """Every template is parsed before a render (17 of 1 MiB each, three renders a record: 128 s a record): at
    most 8 of at most 256K characters together, checked once per tokenizer."""
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    monkeypatch.setattr(tok, "chat_template", {f"t{i}": plain for i in range(9)})
    with pytest.raises(PactError, match="d.jsonl:1: the tokenizer carries 9 chat templates, more than 8"):
        data.check_templates(tok, "d.jsonl:1")
    monkeypatch.setattr(tok, "chat_template", {"default": plain + "{# " + "x" * (300 << 10) + " #}"})
    with pytest.raises(PactError, match=r"chat templates hold \d+ characters, more than 262144"):
        data.check_templates(tok, "d.jsonl:1")
    monkeypatch.setattr(tok, "chat_template", plain + "{# once #}")  # (a template no other test has checked)
    calls = []
    monkeypatch.setattr(data, "template_hazard", lambda src: calls.append(src))
    data.check_templates(tok, "d.jsonl:1")
    data.check_templates(tok, "d.jsonl:2")
    assert len(calls) == 1


def test_a_named_template_is_checked_and_named(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", {"default": SMOLLM2, "tool_use": "{{ 2 ** 99999999 }}"})
    with pytest.raises(PactError, match=r"^x: the chat template 'tool_use' raises to a power"):
        data.render_chat(tok, [{"role": "user", "content": "hi"}], "x")


def test_a_template_that_does_not_parse_still_fails_rendering(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(PactError, match=r"^x: the chat template failed to render \(TemplateSyntaxError: "):
        data.render_chat(tok, [{"role": "user", "content": "hi"}], "x")


# ---- tokenizer regexes: no hours of backtracking, no panic traceback

REAL_PATTERNS = {
    "gpt-2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "llama-3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""",
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
             r"""\s+(?!\S)|\s+""",
    "o200k": r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|"""
             r"""'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|"""
             r"""'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "tekken": r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"""
              r"""[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""",
    "deepseek-v3": r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?"""
                   r"""[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "kimi-k2": r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
               r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"""
               r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "bloom": r""" ?[^(\s|[.,!?…。，、।۔،])]+""",
    "t5-spaces": r""" {2,}""",
    "literal-bracket": r"""[]a]+|[^]b]*""",
}


@pytest.mark.parametrize("name", REAL_PATTERNS)
def test_real_tokenizer_regexes_pass(name):
    assert regex_hazard(REAL_PATTERNS[name]) is None


@pytest.mark.parametrize("pattern,why", [
    (r"(\w+\s?)+$", "repeats a group"), (r"(?:\w|\d)+", "repeats a group"), (r"(a){3}", "repeats a group"),
    (r"a**", "stacks quantifiers (a repeat of a repeat)"), (r"a{2,}+", "stacks quantifiers"),
    (r"x|\w*\w*\w*!", "holds more than two repeats, two optional parts or one alternation group in one alternative"),
    (r"\w{0,50}\w{0,50}\w{0,50}!", "holds more than two repeats"), (r"a?a?a?aaa", "holds more than two repeats"),
    (r"(?:a|aa)(?:a|aa)", "holds more than two repeats"),
    ("(?:" + "|".join("abcdefghi") + ")", "has a group of 9 alternatives"),
    (r"(?<a>a\g<a>?)", "calls a subexpression or has an absent operator"), (r"(?~ab)", "calls a subexpression"),
    (r"[[a]+", "has an unclosed character class"), (r"a)+", "has an unbalanced ')'"),
    ("a" * 1025, "is 1025 characters (bound 1024)"),
])
def test_backtracking_regexes_are_named(pattern, why):
    assert regex_hazard(pattern).startswith(why)


def _with_split(base, tmp_path, regex):
    art = _copy(base, tmp_path)
    f = art / "hf" / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, tj["pre_tokenizer"]]}
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    return art


def test_a_backtracking_regex_is_warned_of_at_load(base, tmp_path, caplog):
    """The check is a heuristic, so it warns (a real model's tokenizer is never refused by it); the hours it
    could take end in Oniguruma's limit, whose panic is one error (below)."""
    art = _with_split(base, tmp_path, r"(\w+\s?)+$")  # the red team's: hours of tokenizing, or a panic
    with caplog.at_level("WARNING", logger="pact.runtime.session"):
        assert load_tokenizer(open_artifact(art))("fresh")["input_ids"]
    assert re.search(r"hf/tokenizer.json: the pre_tokenizer's regex '\(\\\\w\+\\\\s\?\)\+\$' repeats a group: "
                     r"it may backtrack for very long", caplog.text), caplog.text


def test_a_tokenizer_panic_is_one_error(base, tmp_path):
    """A regex within the checks still panics past Oniguruma's limit on a long enough run: PanicException is
    a BaseException, which no `except Exception` sees; every tokenizer call turns it into a PactError."""
    art = _with_split(base, tmp_path, r"[^.]*[^.]*$")
    tok = load_tokenizer(open_artifact(art))
    assert tok("the movie. was fresh")["input_ids"] and tok.decode(tok("fresh")["input_ids"]) == "fresh"
    text = "a" * 6000 + "."
    match = r"hf/tokenizer.json: the tokenizer failed in its Rust library \(Onig: .*retry-limit-in-match over\)"
    for call in (lambda: tok(text), lambda: tok.encode(text), lambda: tok.tokenize(text),
                 lambda: data.tokenize([{"prompt": text, "completion": "x", "_where": "d.jsonl:1"}], tok, max_len=64)):
        with pytest.raises(PactError, match=match):
            call()


def test_a_regex_that_works_too_long_is_stopped(base, tmp_path, monkeypatch):
    """A regex that passes every check at load yet works super-linearly in Rust (this one: 1,000
    letters take ~1 s, 2,000 ~5 s) is stopped by the encodes' time bound: one error naming tokenizer.json once the
    bound is spent, and every later encode refused at once. Real text stays far within it."""
    from pact.runtime import session

    monkeypatch.setattr(session, "ENCODE_GRACE_S", 0.3)
    art = _with_split(base, tmp_path, r"\w{0,400}\w{0,400}\W\d")
    tok = load_tokenizer(open_artifact(art))
    assert isinstance(tok.backend_tokenizer, session.BoundedBackend)
    assert tok("the movie was fresh")["input_ids"] and tok.encode("fresh", "pair")
    assert tok.backend_tokenizer.normalizer is None and tok.backend_tokenizer.get_vocab_size() > 0  # the rest: as is
    t = time.perf_counter()
    with pytest.raises(PactError, match=r"hf/tokenizer.json: encoding 1000 characters took over 0\.3 s \(this "
                                        r"tokenizer's bound: 0.3 s plus 20 us a character encoded.*super-linearly"):
        tok("a" * 1000)
    assert time.perf_counter() - t < 2
    with pytest.raises(PactError, match="an earlier call of this tokenizer ran past its time bound"):
        tok("fresh")
    tok = load_tokenizer(open_artifact(art))  # 120K characters of ordinary text: far within the bound
    assert len(tok(["word, " * 20000])["input_ids"][0]) >= 20000


def test_a_decoder_regex_that_works_too_long_is_stopped(base, tmp_path, monkeypatch):
    """The decoder's regexes run on each token's text: a 2,000-letter token through a super-linear Replace
    took 2.8 s to decode (4,096 letters, the longest token allowed: ~20 s), once per printed token. Decodes
    share the encodes' time bound (a token id counting 64 characters)."""
    from pact.runtime import session

    monkeypatch.setattr(session, "ENCODE_GRACE_S", 0.3)
    art = _copy(base, tmp_path)
    f = art / "hf" / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj["decoder"] = {"type": "Sequence", "decoders": [
        tj["decoder"], {"type": "Replace", "pattern": {"Regex": r"\w{0,400}\w{0,400}\W\d"}, "content": "x"}]}
    top = max([*tj["model"]["vocab"].values(), *(t["id"] for t in tj["added_tokens"])])
    tj["added_tokens"].append({"id": top + 1, "content": "a" * 2000,
                               "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                               "special": False})
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    tok = load_tokenizer(open_artifact(art))
    assert tok.decode(tok("the movie")["input_ids"], skip_special_tokens=True).strip() == "the movie"
    long_id = tj["added_tokens"][-1]["id"]
    t = time.perf_counter()
    with pytest.raises(PactError, match=r"hf/tokenizer.json: decoding 1 tokens took over 0\.3 s .*or decoder works "
                                        r"super-linearly"):
        tok.decode([long_id])
    assert time.perf_counter() - t < 2
    with pytest.raises(PactError, match="an earlier call of this tokenizer ran past its time bound"):
        tok.decode([long_id - 1])


def test_a_tokenizer_whose_load_works_too_long_is_stopped(base, tmp_path, monkeypatch):
    """Building a tokenizer runs its regexes in Rust holding the GIL (a normalized added token goes through
    the normalizer at load: three 4,000-letter ones took 20 s; pact's own probes run each part too): the
    load and the checks run first in a forked child, killed past LOAD_S, with one error naming the file."""
    from pact.runtime import session

    monkeypatch.setattr(session, "LOAD_S", 0.5)
    art = _copy(base, tmp_path)
    f = art / "hf" / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj["normalizer"] = {"type": "Replace", "pattern": {"Regex": r"\w{0,400}\w{0,400}\W\d"}, "content": "x"}
    top = max([*tj["model"]["vocab"].values(), *(t["id"] for t in tj["added_tokens"])])
    tj["added_tokens"].append({"id": top + 1, "content": "\u4e00" + "a" * 2999, "single_word": False,
                               "lstrip": False, "rstrip": False, "normalized": True, "special": False})
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    t = time.perf_counter()
    with pytest.raises(PactError, match=r"hf/tokenizer.json: loading and checking the tokenizer took over 0.5 s "
                                        r"\(real ones take 1-3 s\).*super-linearly"):
        load_tokenizer(open_artifact(art))
    assert time.perf_counter() - t < 3


def test_a_checked_tokenizer_is_remembered(base, tmp_path, monkeypatch):
    """The child runs once per tokenizer: a second load of the same files forks nothing; a changed file
    (another tokenizer) is checked again; the child's refusal is the parent's error, word for word."""
    import os

    from pact.runtime import session

    monkeypatch.setenv("PACT_CACHE", str(tmp_path / "cache"))
    art = _copy(base, tmp_path)
    forks = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or real_fork())
    assert load_tokenizer(open_artifact(art))("fresh")["input_ids"] and len(forks) == 1
    assert load_tokenizer(open_artifact(art))("fresh")["input_ids"] and len(forks) == 1
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    _edit_json(art / "hf" / "tokenizer_config.json", model_max_length="many")
    with pytest.raises(PactError, match=r"tokenizer_config.json: 'model_max_length' is 'many', not a number"):
        load_tokenizer(open_artifact(art))
    assert len(forks) == 2 and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    assert session._tokenizer_digest(open_artifact(art)) != session._tokenizer_digest(open_artifact(base / "art"))


def test_a_tokenizer_built_from_config_keys_is_refused(base, tmp_path):
    """Without tokenizer.json transformers builds the tokenizer from other files or from config keys (a
    'vocab' dict made it compute merges in O(L^2) time and memory a token: 6.4 GB from a 2 MB config)."""
    art = _copy(base, tmp_path)
    _edit_json(art / "hf" / "tokenizer_config.json", vocab={"a": 0})
    with pytest.raises(ArtifactError, match=r"tokenizer_config.json: 'vocab' names a file for the tokenizer"):
        open_artifact(art)
    from pact.runtime.session import _load_checked

    hf = tmp_path / "hf"  # (an artifact missing a listed file is refused at open; the loader refuses it too)
    shutil.copytree(base / "art" / "hf", hf)
    (hf / "tokenizer.json").unlink()
    with pytest.raises(PactError, match=r"hf/tokenizer.json: missing: pact loads an artifact's tokenizer from its "
                                        r"tokenizer.json only"):
        _load_checked(hf)


def test_a_python_tokenizer_class_is_refused(base, tmp_path):
    """tokenizer_config.json's tokenizer_class may name a Python tokenizer (ByT5Tokenizer needs no vocabulary
    file): none of tokenizer.json's checks or bounds would reach it (an added token of 200,000 letters made
    transformers' Python trie take 15.8 s on a 20,000-letter prompt)."""
    art = _copy(base, tmp_path)
    _edit_json(art / "hf" / "tokenizer_config.json", tokenizer_class="ByT5Tokenizer", extra_ids=0)
    with pytest.raises(PactError, match=r"hf: the tokenizer loads as ByT5Tokenizer, not one backed by "
                                        r"tokenizer.json .*tokenizer_class"):
        load_tokenizer(open_artifact(art))


@pytest.mark.parametrize("file,key,many", [("tokenizer_config.json", "extra_special_tokens", 600),
                                           ("special_tokens_map.json", "additional_special_tokens", 600),
                                           ("tokenizer_config.json", "k{}_token", 600),
                                           ("added_tokens.json", "<x{}>", 20000)])
def test_thousands_of_added_tokens_are_refused(base, tmp_path, file, key, many):
    """transformers adds a config's special tokens one by one, each checked against a list of those before it:
    64,000 took 20 s to load (65,536 `k_token` keys too; 300,000 in added_tokens.json 6 s and 1 GB), 4,000 special
    tokens beside 4,000 added ones 15 s, and every chat record asked for their ids again."""
    art = _copy(base, tmp_path)
    if "{}" in key:  # one key per token
        _edit_json(art / "hf" / file, **{key.format(i): (f"<x{i}>" if file != "added_tokens.json" else 50000 + i)
                                         for i in range(many)})
    else:
        _edit_json(art / "hf" / file, **{key: [f"<x{i}>" for i in range(many)]})
    with pytest.raises(ArtifactError, match=rf"hf/{file}: lists \d+ added tokens, or hf/'s files \d+ special tokens "
                                            r"so far, more than 16384 / 512"):
        open_artifact(art)


def test_the_bounded_tokenizer_copies_pickles_and_forks(base, tmp_path):
    """The time-bounded backend stays a usable tokenizer: deep copies and pickles (a fresh allowance and
    worker each), a forked child encodes with a worker of its own, and transformers can wrap it again."""
    import copy
    import os
    import pickle

    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(open_artifact(_copy(base, tmp_path)))
    want = tok("the movie was fresh")["input_ids"]
    for twin in (copy.deepcopy(tok), pickle.loads(pickle.dumps(tok))):
        assert twin("the movie was fresh")["input_ids"] == want
    assert PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)("the movie was fresh")["input_ids"] == want
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, json.dumps(tok("the movie was fresh")["input_ids"]).encode())
        finally:
            os._exit(0)
    os.close(w)
    t = time.perf_counter()
    got = os.read(r, 65536)
    os.waitpid(pid, 0)
    assert json.loads(got) == want and time.perf_counter() - t < 3  # (not the 5 s wait for the parent's worker)


def test_the_encode_bound_counts_every_input_form():
    from pact.runtime.session import _chars

    assert _chars("abc") == 3 and _chars(["ab", ("cd", "e")]) == 5 and _chars([["pre", "tok"], ["x"]]) == 7
    assert _chars(None) == 0


def test_a_tokenizer_panic_is_one_line_from_pact_generate(base, tmp_path):
    from click.testing import CliRunner

    from pact.pipelines.generate import generate_cmd

    art = _with_split(base, tmp_path, r"[^.]*[^.]*$")
    r = CliRunner().invoke(generate_cmd, [str(art), "--prompt", "a" * 6000 + ".", "--max-new-tokens", "2"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines()[-1].startswith(f"Error: {art}/hf/tokenizer.json: the tokenizer failed")


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="the memory bound is Linux's RLIMIT_AS")
@pytest.mark.parametrize("bomb,why", [("{{ 'x'|center(3000000000) }}", "needed over 256 MiB of memory"),
                                      ("{{ 'x'|center(2000000) }}", r"rendered \d+ characters \(bound \d+\)")])
def test_the_tagged_render_is_bounded_too(tok, monkeypatch, bomb, why):
    """A template with {% generation %} tags renders once for the text and its assistant spans, under the same
    bounds as any rendering (time, address space, size); the tokenizing after it is outside the address-space
    bound (the tokenizers library may start its thread pool there)."""
    monkeypatch.setattr(tok, "chat_template", TAGGED.replace("{% generation %}", "{% generation %}" + bomb))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(PactError, match=rf"^c.jsonl:1: .*{why}"):
        data.tokenize([{"messages": msgs, "_where": "c.jsonl:1"}], tok, max_len=64)


def test_the_tagged_mask_is_transformers_own(tok, monkeypatch):
    """The assistant mask pact computes from the bounded render's spans is apply_chat_template's, token for token."""
    monkeypatch.setattr(tok, "chat_template", TAGGED)
    for msgs in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo there"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the movie?"},
                  {"role": "assistant", "content": "fresh"}, {"role": "user", "content": "why"},
                  {"role": "assistant", "content": "it was good"}]):
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert data._tagged_mask(tok, msgs, "x") == (list(ref["input_ids"]), list(ref["assistant_masks"]))


@pytest.mark.parametrize("part,component", [
    ("normalizer", {"type": "Replace", "pattern": {"String": "e"}, "content": "x" * 65}),
    ("normalizer", {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "y" * 1000}]}),
    ("decoder", {"type": "Replace", "pattern": {"String": "e"}, "content": "z" * 4096}),
    # short inserts that chain: each Replace writes 8 'a's for an 'a', three of them 512 for one
    ("normalizer", {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * 8} for _ in range(3)]}),
])
def test_a_tokenizer_that_multiplies_the_text_is_refused(base, tmp_path, part, component):
    """A normalizer or decoder writing a long text in place of every match (a 70-character prompt made 5 GB in
    Rust, past every time bound, in a helper's attack): refused at load, naming the file; a real one's
    replacement of a character or two loads."""
    art = _copy(base, tmp_path)
    f = art / "hf" / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj[part] = component
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    with pytest.raises(PactError, match=rf"hf/tokenizer.json: the {part} writes a (content|prepend) of \d+ characters, "
                                        r"which with its other inserts can multiply a text \d+ times \(bound 64; "
                                        r".*re-run pact-convert on a trusted model"):
        load_tokenizer(open_artifact(art))
    tj[part] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    assert load_tokenizer(open_artifact(art))("the movie")["input_ids"]


@pytest.mark.parametrize("rel", ["special_tokens_map.json", "added_tokens.json", "additional_chat_templates/x.jinja",
                                 "config.json.bak"])
def test_an_unlisted_hf_file_is_refused(base, tmp_path, rel):
    """A file in hf/ the manifest does not list: no checksum covers it, yet transformers reads what it finds there
    (an unlisted special_tokens_map.json changed the tokenizer's EOS with verify() passing, and a copy by URL,
    which fetches listed files only, behaved otherwise): refused at open, naming it; listed, it opens."""
    art = _copy(base, tmp_path)
    f = art / "hf" / rel
    f.parent.mkdir(exist_ok=True)
    f.write_text("{}")
    with pytest.raises(ArtifactError, match=rf"hf/{rel}: a file in hf/ the manifest does not list \(no checksum "
                                            r"covers it.*remove it, or re-copy the artifact or re-run pact-convert"):
        open_artifact(art)
    rehash_artifact(art)
    assert open_artifact(art).verify() > 0
    (art / "hf" / ".ipynb_checkpoints").mkdir()  # what an editor leaves, hidden: read by nothing, not refused
    (art / "hf" / ".ipynb_checkpoints" / "config-checkpoint.json").write_text("{}")
    assert open_artifact(art)


def _charsmap(replacement: str) -> str:
    """A SentencePiece precompiled charsmap (base64) mapping 'a' to ``replacement``: a double-array trie of 256
    units (the root's offset 0; unit 0x61: label 'a', a leaf below it at 0x61 ^ 1, that leaf's value 0, the
    replacement's offset), then the replacements, NUL-terminated."""
    import base64
    import struct

    units = [0] * 256
    units[0x61] = (1 << 10) | (1 << 8) | 0x61
    units[0x60] = 1 << 31
    trie = struct.pack(f"<{len(units)}I", *units)
    return base64.b64encode(struct.pack("<I", len(trie)) + trie + replacement.encode() + b"\0").decode()


def _backend(**parts):
    from tokenizers import Tokenizer, models

    tk = Tokenizer(models.BPE())
    for part, component in parts.items():
        setattr(tk, part, component)
    return tk


def test_real_tokenizer_parts_pass():
    """The parts real tokenizers ship (as transformers' converters write them: ALBERT/T5's charsmap, whose longest
    NFKC replacement is 18 characters, BERT, Llama 2 / Gemma, Llama 3 / Qwen2 byte-level, RoBERTa) load, and
    do what they do to the probe text."""
    from tokenizers import Regex
    from tokenizers import decoders as D
    from tokenizers import normalizers as N
    from tokenizers import pre_tokenizers as P
    from tokenizers import processors as PP

    from pact.runtime.session import _check_components

    charsmap = N.Precompiled(__import__("base64").b64decode(_charsmap("\u0635\u0644\u0649 \u0627\u0644\u0644\u0647 "
                                                                      "\u0639\u0644\u064a\u0647 \u0648\u0633\u0644\u0645")))
    split = Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    for parts in (
        dict(normalizer=N.Sequence([N.Replace("``", '"'), N.Replace("''", '"'), N.NFKD(), N.StripAccents(), N.Lowercase(),
                                    charsmap, N.Replace(Regex(" {2,}"), " ")]),
             pre_tokenizer=P.Metaspace(), decoder=D.Metaspace(),
             post_processor=PP.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])),
        dict(normalizer=N.BertNormalizer(), pre_tokenizer=P.BertPreTokenizer(), decoder=D.WordPiece()),
        dict(normalizer=N.Sequence([N.Prepend("\u2581"), N.Replace(" ", "\u2581")]),
             decoder=D.Sequence([D.Replace("\u2581", " "), D.ByteFallback(), D.Fuse(), D.Strip(" ", 1, 0)])),
        dict(normalizer=N.NFC(), pre_tokenizer=P.Sequence([P.Split(split, "isolated"), P.ByteLevel(use_regex=False)]),
             decoder=D.ByteLevel(), post_processor=PP.Sequence([PP.ByteLevel(trim_offsets=False), PP.TemplateProcessing(
                 single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 128000)])])),
        dict(pre_tokenizer=P.ByteLevel(add_prefix_space=False), decoder=D.ByteLevel(),
             post_processor=PP.RobertaProcessing(("</s>", 2), ("<s>", 0))),
    ):
        _check_components(_backend(**parts), Path("t.json"))


def _hostile(kind):
    from tokenizers import Regex
    from tokenizers import decoders as D
    from tokenizers import normalizers as N
    from tokenizers import pre_tokenizers as P
    from tokenizers import processors as PP

    return {
        # each inserts an 'x' between every two characters: seven of them make a text 128 times as long
        "empty-match": ("normalizer", N.Sequence([N.Replace(Regex("b*"), "x")] * 7), "at every position"),
        "charsmap": ("normalizer", N.Precompiled(__import__("base64").b64decode(_charsmap("b" * 100000))),
                     r"maps a character to up to 100000 characters \(its precompiled_charsmap\)"),
        "bert-chain": ("normalizer", N.Sequence([N.BertNormalizer()] * 4), r"around each CJK character"),
        "byte-chain": ("pre_tokenizer", P.Sequence([P.ByteLevel(use_regex=False)] * 4), r"\(ByteLevel\)"),
        "long-chain": ("normalizer", N.Sequence([N.NFKC()] * 40), r"chains 40 components \(bound 32"),
        # (found by a helper past the first form of these checks) a lookahead matches the empty string before
        # each 'z' only: each Replace doubles the z's, and no probe held a 'z'
        "lookahead": ("normalizer", N.Sequence([N.Replace(Regex("(?=z)"), "z")] * 7), "at every position"),
        # a one-character Replace into a compatibility character NFKC expands 4x, chained: a normal form counts
        # what it makes of the characters written before it
        "nfkc-loop": ("normalizer", N.Sequence([N.Replace("\u222b", "\u2a0c"), N.NFKC()] * 8),
                      r"expands a character the components before it write to 4 \(NFKC\)"),
        # the same with a first step deleting every character a probe could hold (a helper's second round)
        "nfkc-deleter": ("normalizer", N.Sequence([N.Replace(Regex(r"\P{Cyrillic}"), ""),
                                                   N.Replace(Regex(r"\p{Cyrillic}"), "\ufdfa"),
                                                   *[N.NFKC(), N.Replace(Regex("[\u0600-\u06ff]"), "\ufdfa")] * 2]),
                         r"expands a character the components before it write to 18 \(NFKC\)"),
        # (a third round) Oniguruma reads a lazy fixed count `x{1}?` as optional, so it matches the empty string
        "lazy-count": ("normalizer", N.Sequence([N.Replace(Regex("(?=\u03b2)x{1}?"), "\u03b1")] * 7),
                       "at every position"),
        # Metaspace prepends to every piece and splits at each replacement: alternating ones grow a Fibonacci
        # chain, which only pieces carried from step to step show
        "metaspace-chain": ("pre_tokenizer", P.Sequence([P.Metaspace(replacement=r, prepend_scheme="always", split=True)
                                                         for r in "ab" * 16]),
                            r"makes \d+ characters of the \d+-character probe text"),
        # (a fourth round) NFKC makes 18 of the user's U+FDFA, which a Replace after it multiplies by 63
        "nfkc-then-replace": ("normalizer", N.Sequence([N.NFKC(), N.Replace(
            Regex("[\u0635\u0644\u0649\u0627\u0647\u0639\u064a\u0648\u0633\u0645]"), "x" * 63)]),
                              r"makes \d+ characters of the 8-character probe text"),
        "bpe-decoder": ("decoder", D.Sequence([D.BPEDecoder(suffix="")] * 4),
                        r"writes a space between every two characters \(BPEDecoder"),
        "repeated-input": ("post_processor", PP.TemplateProcessing(single=["$A"] * 100, special_tokens=[]),
                           r"single template holds 100 copies of 1 input\(s\) \(\$A\)"),
        "long-special": ("post_processor", PP.TemplateProcessing(
            single="$A [X]", special_tokens=[{"id": "[X]", "ids": [1], "tokens": ["z" * 5000]}]),
                         r"adds a special token of 5000 characters \(bound 4096\)"),
        "special-ids": ("post_processor", PP.TemplateProcessing(
            single="$A [X]", special_tokens=[{"id": "[X]", "ids": list(range(5000)), "tokens": ["a"] * 5000}]),
                        r"template for a text has \d+ pieces and special ids \(bound 1024"),
    }[kind]


@pytest.mark.parametrize("kind", ["empty-match", "charsmap", "bert-chain", "byte-chain", "long-chain", "special-ids",
                                  "lookahead", "nfkc-loop", "repeated-input", "long-special", "nfkc-deleter",
                                  "bpe-decoder", "lazy-count", "metaspace-chain", "nfkc-then-replace"])
def test_a_tokenizer_that_grows_the_text_past_the_inserts_is_refused(base, tmp_path, kind):
    """What the insert bound missed in a helper's attack: a Replace whose pattern matches the empty string (each
    doubles the text: 22 chained took 2.7 GB), a SentencePiece charsmap mapping a character to megabytes, chains
    of BertNormalizers or byte-level maps, thousands of chained components (quadratic), a post-processor adding
    millions of ids (0.45 s and 1 GB an encode): refused when the artifact's tokenizer loads, naming the file."""
    part, component, why = _hostile(kind)
    art = _copy(base, tmp_path)
    f = art / "hf" / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj[part] = json.loads(component.__getstate__())
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    with pytest.raises(PactError, match=rf"hf/tokenizer.json: the {part}\W.*{why}.*re-run pact-convert on a trusted"):
        load_tokenizer(open_artifact(art))


def test_the_probe_catches_growth_the_static_bound_misses(monkeypatch):
    """Second line: whatever the static bound does not model (here: none of it, switched off) is measured on a
    probe text, each part at most 64 times it."""
    from pact.runtime import session

    monkeypatch.setattr(session, "_growth", lambda doc, part: iter(()))
    part, component, _ = _hostile("empty-match")
    with pytest.raises(PactError, match=r"t.json: the normalizer makes \d+ characters of the \d+-character probe text "
                                        r".* \(bound 64x\)"):
        session._check_components(_backend(**{part: component}), Path("t.json"))


def test_a_megabyte_token_is_refused(base, tmp_path):
    """An added token of 4 MB (each generated one printed 4 MB, the printer re-decoding the reply: quadratic):
    refused at load past 4096 characters."""
    art = _copy(base, tmp_path)
    f = art / "hf" / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj["added_tokens"].append({"id": len(tj["model"]["vocab"]), "content": "z" * 5000, "single_word": False,
                               "lstrip": False, "rstrip": False, "normalized": False, "special": False})
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    with pytest.raises(PactError, match=r"hf/tokenizer.json: a token of the vocabulary is 5000 characters long "
                                        r"\(bound 4096"):
        load_tokenizer(open_artifact(art))


def test_the_model_settings_that_grow_an_encode_are_refused(base, tmp_path):
    """A BPE subword prefix of megabytes (allocated for every piece) and WordPiece's longest word at 10^9 (its
    work grows as the cube of a word): refused at load."""
    from tokenizers import Tokenizer, models

    from pact.runtime.session import _check_model

    art = _copy(base, tmp_path)
    f = art / "hf" / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj["model"]["continuing_subword_prefix"] = "#" * 100000
    f.write_text(json.dumps(tj))
    rehash_artifact(art)
    with pytest.raises(PactError, match=r"hf/tokenizer.json: the model's continuing_subword_prefix is 100000 "
                                        r"characters \(bound 16"):
        load_tokenizer(open_artifact(art))
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "c": 1}, unk_token="[UNK]", max_input_chars_per_word=10 ** 9))
    with pytest.raises(PactError, match=r"t.json: the model's max_input_chars_per_word is 1000000000 \(bound 256"):
        _check_model(wp, Path("t.json"))
    _check_model(Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]")), Path("t.json"))  # BERT's 100


def test_padding_and_truncation_of_the_file_are_cleared():
    """tokenizer.json's own padding (fixed at 10^8: one encode ran out of memory) and truncation (a stride of one:
    an overflow per token) are cleared at load; transformers sets what each call asks."""
    from pact.runtime.session import _check_components

    tk = _backend()
    tk.enable_padding(length=10 ** 8)
    tk.enable_truncation(4000, stride=3999)
    _check_components(tk, Path("t.json"))
    assert tk.padding is None and tk.truncation is None


def test_growth_across_parts_and_of_decoded_tokens_is_bounded(monkeypatch):
    """The normalizer's growth and the pre-tokenizer's multiply (64 x a byte-level map's 4: refused); a token's
    decode is its length times the decoder's growth (4000 characters x 64: refused); a Unigram piece past 128
    characters (the lattice grows as its square per character); a part holding more distinct characters than
    any real one (the probe runs on them); a component of a type pact does not know counts as unbounded."""
    from tokenizers import Tokenizer, models
    from tokenizers import decoders as D
    from tokenizers import normalizers as N
    from tokenizers import pre_tokenizers as P

    from pact.runtime import session

    where = Path("t.json")
    with pytest.raises(PactError, match=r"the pre_tokenizer maps a character to up to 4 characters \(ByteLevel\), "
                                        r"which with the normalizer's and its other inserts can multiply a text 256"):
        session._check_components(_backend(normalizer=N.Replace("a", "b" * 64), pre_tokenizer=P.ByteLevel()), where)
    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "a" * 4000: 1}, unk_token="[UNK]"))
    tk.decoder = D.Replace("a", "b" * 64)
    with pytest.raises(PactError, match=r"a token of 4000 characters decodes to up to 256000 \(the decoder "
                                        r"multiplies by 64; bound 16384\)"):
        session._check_token_lengths(tk, where, session._check_components(tk, where))
    uni = Tokenizer(models.Unigram([("<unk>", 0.0), ("a" * 200, -1.0)], unk_id=0))
    with pytest.raises(PactError, match=r"a Unigram piece is 200 characters long \(bound 128"):
        session._check_token_lengths(uni, where)
    with pytest.raises(PactError, match=r"the normalizer holds 40000 distinct characters \(bound 32768"):
        session._check_components(_backend(normalizer=N.Replace("".join(map(chr, range(0x10000, 0x10000 + 40000))),
                                                                "")), where)
    monkeypatch.setitem(session.KNOWN, "normalizer", session.KNOWN["normalizer"] - {"NFC"})
    with pytest.raises(PactError, match=r"the normalizer has a component of type 'NFC', whose growth pact does not "
                                        r"know"):
        session._check_components(_backend(normalizer=N.NFC()), where)
