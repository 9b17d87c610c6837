"""Chat templates: where the compiler finds them (a folder's chat_template.jinja or tokenizer_config.json, a GGUF
file's tokenizer.chat_template), and how dejavu-serve renders them (against transformers' renderer)."""
from __future__ import annotations

import json

import pytest

from dejavu.errors import DejavuError

pytest.importorskip("jinja2")

# templates in the forms real checkpoints ship: Llama 3.2's date line (strftime_now, bos_token written by the
# template), Mistral's alternation check (raise_exception), a tool-style one (tojson with its arguments, a
# loop control); each reduced to what it exercises
LLAMA = ("{{- bos_token }}\n{%- if not date_string is defined %}\n{%- if strftime_now is defined %}\n"
         "{%- set date_string = strftime_now(\"%d %b %Y\") %}\n{%- else %}\n{%- set date_string = \"26 Jul 2024\" %}\n"
         "{%- endif %}\n{%- endif %}\n{%- if messages[0]['role'] == 'system' %}\n"
         "{%- set system_message = messages[0]['content']|trim %}\n{%- set messages = messages[1:] %}\n{%- else %}\n"
         "{%- set system_message = \"\" %}\n{%- endif %}\n"
         "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
         "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n{%- for message in messages %}\n"
         "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
         "'<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
         "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}")
TOOLS = ("{%- for m in messages %}{%- if m['content'] == 'STOP' %}{%- break %}{%- endif %}<|im_start|>{{ m['role'] }}\n"
         "{{ m | tojson }}|{{ m | tojson(indent=2) }}<|im_end|>\n{% endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "  Be brief <b>&'é  "}, {"role": "user", "content": "The game"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "STOP"},
            {"role": "user", "content": "after"}]


def _tok():
    from tiny_tokenizer import tiny_tokenizer_json

    from dejavu.models.tokenizer import TextTokenizer

    return TextTokenizer(tiny_tokenizer_json(), 0, 2, 1)


@pytest.mark.parametrize("template", [LLAMA, TOOLS, MISTRAL], ids=["llama", "tools", "mistral"])
def test_rendered_as_transformers_renders(template):
    from transformers import PreTrainedTokenizerFast
    from transformers.utils.chat_template_utils import render_jinja_template

    from dejavu.runtime.openai_protocol import ChatTemplate

    tok = _tok()
    msgs = MESSAGES[1:3] + MESSAGES[4:] if template is MISTRAL else MESSAGES
    want = render_jinja_template(conversations=[msgs], chat_template=template, add_generation_prompt=True,
                                 bos_token="<s>", eos_token="</s>")[0][0]
    ct = ChatTemplate(template, tok)
    assert ct.template.render(messages=msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>") == want
    # the ids transformers' apply_chat_template gives (vLLM's chat prompt too): BOS where the template writes it
    # (llama, mistral), none where it does not (tools: ChatML's form)
    ref = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, bos_token="<s>", eos_token="</s>")
    ids = ref.apply_chat_template(msgs, chat_template=template, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    assert ct.encode(msgs) == ids
    assert ids[:2].count(0) == (0 if template is TOOLS else 1) and ids.count(0) == want.count("<s>")


def test_a_template_that_refuses_the_messages_is_a_400_with_its_message():
    from dejavu.runtime.openai_protocol import ChatTemplate

    with pytest.raises(Exception, match="rejected the messages: Conversation roles must alternate") as e:
        ChatTemplate(MISTRAL, _tok()).encode(MESSAGES[1:2] * 2)
    assert getattr(e.value, "status", None) == 400


def test_folder_chat_template_as_transformers_loads_it(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from dejavu.models.auto import folder_chat_template
    from llama_helpers import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "f")
    assert folder_chat_template(folder) is None
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": TOOLS}, {"name": "default", "template": MISTRAL}]}))
    assert folder_chat_template(folder) == MISTRAL
    assert PreTrainedTokenizerFast.from_pretrained(folder).get_chat_template() == MISTRAL  # the same pick
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA}))
    assert folder_chat_template(folder) == LLAMA
    (folder / "chat_template.jinja").write_text(TOOLS)  # transformers >= 4.50 writes it here; it comes first
    assert folder_chat_template(folder) == TOOLS
    assert PreTrainedTokenizerFast.from_pretrained(folder).get_chat_template() == TOOLS
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe bad")
    with pytest.raises(DejavuError, match="chat_template.jinja: unreadable"):
        folder_chat_template(folder)


def test_gguf_chat_template(tmp_path):
    import gguf

    from dejavu.models.auto import load_chat_template

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_chat_template(LLAMA)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_chat_template(str(path)) == LLAMA


# Qwen3's switch, reduced: thinking on unless the request's chat_template_kwargs turn it off
QWEN3 = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n"
         "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
         "{%- endif %}")


def test_chat_request_template_kwargs_and_generation_prompt_as_transformers_renders():
    """vLLM's chat request extensions: chat_template_kwargs become template variables (Qwen3's enable_thinking)
    and add_generation_prompt may be turned off, each equal to transformers' apply_chat_template with the same
    arguments; a kwarg the server sets itself, or a wrong type, is a 400 naming the field."""
    from transformers import PreTrainedTokenizerFast

    from dejavu.runtime.openai_protocol import ChatTemplate, SamplingDefaults, chat_params

    tok = _tok()
    ct, ref = ChatTemplate(QWEN3, tok), PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, bos_token="<s>",
                                                                eos_token="</s>")
    msgs = MESSAGES[:3]

    def want(**kw):
        return ref.apply_chat_template(msgs, chat_template=QWEN3, tokenize=True, return_dict=True, **kw)["input_ids"]

    def got(**body):
        return chat_params({"messages": msgs, **body}, tok, ct, SamplingDefaults()).prompts[0]

    assert got() == want(add_generation_prompt=True)
    off = got(chat_template_kwargs={"enable_thinking": False})
    assert off == want(add_generation_prompt=True, enable_thinking=False) and len(off) > len(got())
    assert got(add_generation_prompt=False) == want(add_generation_prompt=False)
    for body, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                        ({"add_generation_prompt": "yes"}, "add_generation_prompt")):
        with pytest.raises(Exception) as e:
            got(**body)
        assert (getattr(e.value, "status", None), getattr(e.value, "param", None)) == (400, param)


@pytest.mark.parametrize("template", [QWEN3, LLAMA, MISTRAL], ids=["qwen3", "llama-trims", "mistral"])
def test_continue_final_message_as_transformers_cuts_it(template):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message, for the model to go on
    with it, equal to transformers' apply_chat_template(continue_final_message=True), also where the template
    trims the content (Llama's `| trim`) and the message ends in spaces; with add_generation_prompt (the default)
    it is a 400, as transformers refuses the two together."""
    from transformers import PreTrainedTokenizerFast

    from dejavu.runtime.openai_protocol import ChatTemplate, SamplingDefaults, chat_params

    tok = _tok()
    ct, ref = ChatTemplate(template, tok), PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, bos_token="<s>",
                                                                   eos_token="</s>")
    for last in ("The answer is", "The answer is  ", "x\n"):
        msgs = [MESSAGES[1], {"role": "assistant", "content": last}]
        want = ref.apply_chat_template(msgs, chat_template=template, tokenize=True, return_dict=True,
                                       continue_final_message=True)["input_ids"]
        got = chat_params({"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}, tok,
                          ct, SamplingDefaults()).prompts[0]
        assert got == want, last
        assert tok.decode(got).rstrip().endswith(last.strip())
    for body in ({"continue_final_message": True}, {"continue_final_message": 1, "add_generation_prompt": False}):
        with pytest.raises(Exception) as e:
            chat_params({"messages": msgs, **body}, tok, ct, SamplingDefaults())
        assert (getattr(e.value, "status", None), getattr(e.value, "param", None)) == (400, "continue_final_message")
