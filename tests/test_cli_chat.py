"""``sparsekv generate --chat``: the prompt as the user's turn of the tokenizer's chat template (the helper eval's
``--chat`` uses), off by default, and a clear error for a tokenizer without one."""

import pytest

from sparsekv import cli
from sparsekv.cli import main
from sparsekv.models import chat_prompt
from sparsekv.spec import build_config
from sparsekv.tiny import byte_tokenizer, tiny_model

TEMPLATE = ("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>[assistant] {% endif %}")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_model("llama", layers=2, max_positions=512).save_pretrained(path)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def test_chat_prompt_wraps_the_user_turn():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    assert chat_prompt(tokenizer, "What is 2+2?") == "<s>[user] What is 2+2?</s><s>[assistant] "
    with pytest.raises(ValueError, match="--chat: the model's tokenizer has no chat template"):
        chat_prompt(byte_tokenizer(), "What is 2+2?")


def test_generate_feeds_the_templated_prompt_only_with_chat():
    model, tokenizer = tiny_model("llama", layers=2), byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    dense = build_config("dense")
    plain = cli.generate(model, tokenizer, dense, "hello", 2)
    chat = cli.generate(model, tokenizer, dense, "hello", 2, chat=True)
    assert plain.prompt_tokens == len(tokenizer("hello").input_ids)
    # the template's own special tokens (4) and 23 bytes
    assert chat.prompt_tokens == len(tokenizer("<s>[user] hello</s><s>[assistant] ", add_special_tokens=False)
                                     .input_ids) == 27


def test_cli_generate_chat_flag(chat_dir, capsys):
    argv = ["generate", "--model", chat_dir, "--method", "dense", "--prompt", "hello", "--max-new-tokens", "2",
            "--no-progress"]
    assert main(argv) == 0
    assert "prefill of 5 tokens" in capsys.readouterr().err  # off by default: the 5 bytes
    assert main([*argv, "--chat"]) == 0
    assert "prefill of 27 tokens" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny:llama", "--prompt", "hello", "--chat", "--max-new-tokens", "2"]) == 2
    assert "sparsekv generate: error: --chat: the model's tokenizer has no chat template" in capsys.readouterr().err
