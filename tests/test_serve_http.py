"""The OpenAI-compatible server on a tiny model, through the ``openai`` client and raw HTTP (httpx), on 127.0.0.1
only: completions, chat, streaming, usage, stop strings, the errors (each followed by a request that succeeds), a
full queue, a client that leaves mid-stream (its rows come back), failures inside the engine's steps and the
handlers (the server serves on), metrics, and SIGTERM draining a running stream."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from sparsekv.errors import ConfigError  # noqa: E402
from sparsekv.serve import ServingEngine  # noqa: E402
from sparsekv.serve.server import StopStrings, create_app, running  # noqa: E402
from sparsekv.spec import build_config  # noqa: E402
from sparsekv.tiny import byte_tokenizer, tiny_model  # noqa: E402

NAME = "tiny"
MAX_BATCH, MAX_CONTEXT, MAX_QUEUE = 2, 2048, 1
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'developer' %}{{ raise_exception('no developer role') }}"
                 "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@contextlib.contextmanager
def serving(max_queue: int, prefix_cache_bytes: int = 0):
    """A server of a tiny model with Quest on 127.0.0.1 (its URL), for the module's tests."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_model("llama", layers=2, max_positions=MAX_CONTEXT)
    engine = ServingEngine(model, build_config("quest", 64), tokenizer=tokenizer, max_batch=MAX_BATCH,
                           max_context=MAX_CONTEXT, prefill_chunk=64, max_queue=max_queue,
                           prefix_cache_bytes=prefix_cache_bytes)
    with running(create_app(engine, tokenizer, NAME)) as url:
        yield url


@pytest.fixture(scope="module")
def server():
    with serving(MAX_QUEUE) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def roomy_server():
    """A second server, whose queue takes several choices and prompts at once, with a prefix cache."""
    with serving(8, 64 << 20) as url:
        yield url


@pytest.fixture(scope="module")
def roomy(roomy_server):
    return openai.OpenAI(base_url=roomy_server + "/v1", api_key="unused", max_retries=0, timeout=30)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def check_still_serves(client) -> None:
    out = client.completions.create(model=NAME, prompt="ok", max_tokens=3, temperature=0, extra_body={
        "ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_completion_text_usage_and_length(client):
    out = client.completions.create(model=NAME, prompt="The grass is", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == NAME
    assert out.choices[0].finish_reason == "length" and isinstance(out.choices[0].text, str)
    assert out.usage.prompt_tokens == len("The grass is") and out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5


def test_stream_gives_the_same_text_with_usage_last(client):
    whole = client.completions.create(model=NAME, prompt=[100, 101, 102], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=NAME, prompt=[100, 101, 102], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 3 == whole.usage.prompt_tokens


def test_sampling_with_a_seed_repeats(client):
    def draw():
        return client.completions.create(model=NAME, prompt="abc", max_tokens=8, temperature=1.0, top_p=0.9,
                                         seed=7, extra_body={"ignore_eos": True}).choices[0].text
    assert draw() == draw()


def test_stop_string_cuts_the_text_and_ends_the_request(client):
    text = client.completions.create(model=NAME, prompt="stop here", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[5:7]
    out = client.completions.create(model=NAME, prompt="stop here", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt="stop here", max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len("system: Be brief.\nuser: Hello\nassistant:")
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=6,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # OpenAI's shape: the role in the first chunk alone, with empty content
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "")
    assert all(c.choices[0].delta.role is None for c in chunks[1:])


def test_nulls_take_the_defaults_and_tiny_temperatures_are_greedy(server, client):
    body = {"model": NAME, "prompt": "abc", "max_tokens": 6, "ignore_eos": True}
    greedy = httpx.post(server + "/v1/completions", json={**body, "temperature": 0}).json()
    for fields in ({"temperature": 1e-6}, {"temperature": None, "top_k": 1, "n": None, "stream": None,
                                           "stop": None, "seed": None, "logit_bias": None, "top_p": None}):
        r = httpx.post(server + "/v1/completions", json={**body, **fields})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_models_by_name_and_openai_errors_for_unknown_paths(server, client):
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other")
    assert err.value.body["code"] == "model_not_found"
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, server + path)
        assert r.status_code == status and path in r.json()["error"]["message"], r.text
    check_still_serves(client)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    text = httpx.get(server + "/metrics").text
    for name in ("sparsekv_requests_running", "sparsekv_requests_queued", "sparsekv_generation_tokens_per_second",
                 "sparsekv_kv_bytes_in_use", "sparsekv_generated_tokens_total", "sparsekv_swap_seconds_total"):
        assert f"\n{name} " in text
    assert metric(server, "sparsekv_generated_tokens_total") > 0


def test_latency_histograms(server, client):
    """Time to first token, per output token and per request, as Prometheus histograms (cumulative buckets)."""
    before = {name: metric(server, name + "_count") for name in ("sparsekv_time_to_first_token_seconds",
                                                                 "sparsekv_time_per_output_token_seconds",
                                                                 "sparsekv_request_latency_seconds")}
    prompt_tokens = metric(server, "sparsekv_prompt_tokens_total")
    for _ in range(2):
        client.completions.create(model=NAME, prompt="abcd", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert metric(server, "sparsekv_prompt_tokens_total") == prompt_tokens + 8
    text = httpx.get(server + "/metrics").text
    for name, count in before.items():
        assert metric(server, name + "_count") == count + 2 and metric(server, name + "_sum") > 0
        buckets = [float(line.split()[1]) for line in text.splitlines() if line.startswith(name + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == count + 2
        assert f'{name}_bucket{{le="+Inf"}}' in text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi"}, "model"),
    ({"model": NAME}, "prompt"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "temperature": 5}, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": NAME, "prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"model": NAME, "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": NAME, "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": NAME, "prompt": [1, "a"]}, "prompt"),
    ({"prompt": "hi", "model": None}, "model"),
    ({"model": NAME, "prompt": "hi", "n": 0}, "n"),
    ({"model": NAME, "prompt": "hi", "n": 2}, "n"),  # more choices than max_queue
    ({"model": NAME, "prompt": ["hi", "ho"]}, "prompt"),  # more prompts than max_queue
    ({"model": NAME, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": NAME, "prompt": "hi", "frequency_penalty": "high"}, "frequency_penalty"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"model": NAME, "prompt": "hi", "top_k": -2}, "top_k"),
    ({"model": NAME, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"model": NAME, "prompt": "hi", "stop_token_ids": [100000]}, "stop_token_ids"),  # outside the vocabulary
    ({"model": NAME, "prompt": "hi", "stop": 5}, "stop"),
    ({"model": NAME, "prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"model": NAME, "prompt": "hi", "min_tokens": 3}, "min_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokns": 3}, "max_tokns"),  # a misspelling is not ignored
    ({"model": NAME, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": NAME, "prompt": "hi", "logprobs": 6}, "logprobs"),
    ({"model": NAME, "prompt": "hi", "echo": True}, "echo"),
    ({"model": NAME, "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": NAME, "prompt": [1, -2]}, "prompt"),
    ({"model": NAME, "prompt": [1, 100000]}, "prompt"),
    ({"model": NAME, "prompt": []}, "prompt"),
    # numbers past what the engine's tensors hold, and keys str.isdigit takes that are no token ids
    ({"model": NAME, "prompt": "hi", "top_k": 2**70}, "top_k"),
    ({"model": NAME, "prompt": "hi", "repetition_penalty": 1e300}, "repetition_penalty"),
    ({"model": NAME, "prompt": "hi", "seed": 2**64}, "seed"),
    ({"model": NAME, "prompt": "hi", "seed": -1}, "seed"),
    ({"model": NAME, "prompt": "hi", "n": 2**70}, "n"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "logprobs": 2**70}, "logprobs"),
    ({"model": NAME, "prompt": "hi", "temperature": 1e300}, "temperature"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"5": 1e300}}, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # '²'
    ({"model": NAME, "prompt": "hi", "logit_bias": {"\u0663": 1}}, "logit_bias"),  # '٣', an Arabic-Indic 3
    ({"model": NAME, "prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {str(2**64): 1}}, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"model": NAME, "prompt": [2**70]}, "prompt"),
    ({"model": NAME, "prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
])
def test_bad_fields_give_400_naming_the_field(server, client, body, param):
    r = httpx.post(server + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
    check_still_serves(client)


@pytest.mark.parametrize("field, value, allowed", [
    ("top_k", 2**70, "an int from -1 to 2**63 - 1"), ("seed", 2**62, "an int from 0 to 2**62 - 1"),
    ("n", 0, "an int from 1 to 128"), ("temperature", 2.5, "a number from 0 to 2"),
    ("top_p", 0, "a number > 0 and <= 1"), ("repetition_penalty", 0, "a number from 0.01 to 100"),
    ("min_p", -1, "a number from 0 to 1"), ("max_tokens", 0, "an int >= 1"), ("logprobs", 6, "an int from 0 to 5"),
    ("stop_token_ids", [-1], "an int >= 0"), ("logit_bias", {"1": -101}, "a number from -100 to 100"),
])
def test_a_number_out_of_range_is_refused_naming_the_range(server, field, value, allowed):
    r = httpx.post(server + "/v1/completions", json={"model": NAME, "prompt": "hi", field: value})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and f"must be {allowed}" in error["message"], r.text
    assert error["message"].startswith(field)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": {"x": "y" * 100_000}}, "prompt"), ({"prompt": [[1] * 100_000, "x"]}, "prompt"),
    ({"prompt": "hi", "stop": ["a" * 1000] * 50}, "stop"),
    ({"prompt": "hi", "max_tokens": "9" * 100_000}, "max_tokens"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias"),
    ({"prompt": "hi", "suffix": "s" * 100_000}, "suffix"),
])
def test_a_long_bad_value_is_echoed_cut(server, client, fields, param):
    """A client's megabyte of bad input comes back as a few hundred characters, its length said."""
    r = httpx.post(server + "/v1/completions", json={"model": NAME, **fields})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and len(error["message"]) < 500, r.text[:300]
    assert "characters)" in error["message"] or "items starting" in error["message"]
    check_still_serves(client)


def test_penalties_logit_bias_top_k_and_stop_token_ids(client):
    def text(**fields):
        out = client.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True, **fields.pop("extra", {})}, **fields)
        return out.choices[0]

    plain = text()
    assert text(logit_bias={"123": 100}).text == "x" * 16  # byte 'x' is token 123
    assert text(frequency_penalty=2.0).text != plain.text
    assert text(presence_penalty=-2.0, frequency_penalty=0.0, extra={"top_k": 1}).text != plain.text
    assert text(extra={"top_k": -1}).text == plain.text == text(extra={"top_k": 0}).text
    assert text(extra={"repetition_penalty": 3.0}).text != plain.text
    assert text(extra={"min_p": 1.0, "temperature": 1.0}, seed=3).text == plain.text  # only the likeliest is left
    char = next(c for c in plain.text[1:] if c.isascii())
    cut = text(extra={"stop_token_ids": [ord(char) + 3]})  # the byte tokenizer's id of an ASCII character
    assert cut.finish_reason == "stop" and cut.text == plain.text[:plain.text.index(char)]
    assert cut.text != plain.text
    forced = text(logit_bias={"123": 100}, extra={"stop_token_ids": [123]})
    assert forced.finish_reason == "stop" and forced.text == ""
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logit_bias={"123": 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "xxxxx"


def test_bad_chat_fields_give_400(server, client):
    r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "robot",
                                                                                         "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "developer",
                                                                                         "content": "hi"}]})
    assert r.status_code == 400 and "no developer role" in r.json()["error"]["message"]
    check_still_serves(client)


def test_a_chat_limit_is_named_by_the_field_the_client_sent(server, client):
    messages = [{"role": "user", "content": "hi"}]
    for field in ("max_completion_tokens", "max_tokens"):
        r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": messages,
                                                              field: MAX_CONTEXT + 1})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, r.text
        assert error["message"].startswith(f"{field} must be at most max_new_tokens ({MAX_CONTEXT})")
    r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": messages, "top_logprobs": 2**70,
                                                          "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    check_still_serves(client)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "x\\udc00"}]}]}', "messages"),
    ("/v1/completions", '{"model": "tiny", "prompt": "a", "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", '{"model": "tiny", "prompt": "a", "\\ud800": 1}', "\\ud800"),
], ids=["prompt", "prompts", "message", "message-part", "stop", "key"])
def test_a_lone_surrogate_is_refused_naming_the_field(server, client, path, body, param):
    """A \\ud800 escape that is not half of a pair is no character: no tokenizer takes it."""
    r = httpx.post(server + path, content=body, headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and "lone surrogate" in error["message"], r.text
    assert error["type"] == "invalid_request_error"
    # a pair is a character
    r = httpx.post(server + "/v1/completions", content='{"model": "tiny", "prompt": "\\ud83d\\ude00", '
                   '"max_tokens": 2}', headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content, message", [
    (b'{"model": "tiny", "prompt": "\xff"}', "not valid UTF-8: byte 0xff at offset 29"),
    (b'{"model": "tiny", "prompt": "\xc3"}', "not valid UTF-8: byte 0xc3 at offset 29"),
    (b'{"model": "tiny",\n "prompt": "a",, }', "not valid JSON: Expecting property name enclosed in double quotes "
                                               "at line 2, column 16"),
    (b'{"model": "tiny", "prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper than 32 levels"),
    (b'{"model": "tiny", "prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "x: the request body nests arrays "
                                                                             "and objects deeper than 32 levels"),
    (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"model": "tiny", "prompt": "a", "x": ' + b"9" * 5000 + b"}", "an integer of 5000 digits"),
], ids=["latin-1", "cut-character", "two-commas", "nested-5000", "nested-40", "nan", "long-int"])
def test_a_body_that_is_not_json_says_what_is_wrong(server, client, content, message):
    r = httpx.post(server + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    check_still_serves(client)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
def test_malformed_json_gives_400(server, client, content):
    r = httpx.post(server + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    check_still_serves(client)


def test_a_body_sent_as_a_form_gives_400_naming_the_content_type(server, client):
    """curl's -d sends a form: the error says which Content-Type the body needs."""
    r = httpx.post(server + "/v1/completions", content=json.dumps({"model": NAME, "prompt": "hi"}),
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    assert "application/x-www-form-urlencoded" in r.json()["error"]["message"]
    check_still_serves(client)


def test_unknown_model_gives_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    check_still_serves(client)


def test_prompt_over_capacity_gives_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt=[5] * (MAX_CONTEXT - 50), max_tokens=100)
    assert "max_context" in err.value.body["message"] and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt=[5] * (MAX_CONTEXT + 3), max_tokens=1)
    assert "max_context" in err.value.body["message"] and err.value.body["param"] == "prompt"
    assert err.value.body["code"] == "context_length_exceeded"
    check_still_serves(client)


def test_max_tokens_over_max_new_tokens_gives_400_naming_the_limit():
    tokenizer = byte_tokenizer()
    engine = ServingEngine(tiny_model("llama", layers=1, max_positions=256), build_config("dense"),
                           tokenizer=tokenizer, max_batch=1, max_context=256, prefill_chunk=64, max_new_tokens=8)
    with running(create_app(engine, tokenizer, NAME)) as url:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 9}
        r = httpx.post(url + "/v1/completions", json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "max_tokens" and "max_new_tokens (8)" in error["message"]
        r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 8, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_the_engine_thread_prepares_the_runner_then_serves_and_a_failed_preparation_is_logged(monkeypatch, caplog):
    """``Runner.prepare`` (cuDNN's plans, kept per thread by PyTorch) runs in the thread that steps the engine; where
    it fails, the server logs it and serves all the same (the passes build the plans they meet)."""
    import threading

    from sparsekv.serve.runner import Runner

    threads = []

    def prepare(self):
        threads.append(threading.current_thread().name)
        raise RuntimeError("no plans today")

    monkeypatch.setattr(Runner, "prepare", prepare)
    tokenizer = byte_tokenizer()
    engine = ServingEngine(tiny_model("llama", layers=1, max_positions=256), build_config("dense"),
                           tokenizer=tokenizer, max_batch=1, max_context=256, prefill_chunk=64)
    with caplog.at_level("ERROR", logger="sparsekv.serve"), running(create_app(engine, tokenizer, NAME)) as url:
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert threads == ["sparsekv-engine"]
    assert "building the prompt attention plans failed" in caplog.text


def test_full_queue_gives_429_and_a_disconnect_frees_rows(server, client):
    """MAX_BATCH long requests run, MAX_QUEUE wait; one more is refused with 429. Every client then leaves
    mid-stream: the rows come back to the pool, and the server still answers."""
    long = {"model": NAME, "prompt": "x", "max_tokens": MAX_CONTEXT - 1, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.Client(timeout=30) as http, contextlib.ExitStack() as stack:
        streams, lines = [], []  # each stream's line iterator is kept: dropping one closes its stream
        for i in range(MAX_BATCH + MAX_QUEUE):
            streams.append(stack.enter_context(http.stream("POST", server + "/v1/completions", json=long)))
            assert streams[-1].status_code == 200
            lines.append(streams[-1].iter_lines())
            if i < MAX_BATCH:  # running once it streams
                next(lines[-1])
        assert metric(server, "sparsekv_free_rows") == 0 and metric(server, "sparsekv_requests_queued") == MAX_QUEUE
        r = http.post(server + "/v1/completions", json={**long, "stream": False})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"
        for s in streams:
            s.close()
    deadline = time.monotonic() + 20
    while metric(server, "sparsekv_free_rows") != MAX_BATCH or metric(server, "sparsekv_requests_queued"):
        assert time.monotonic() < deadline, "rows of disconnected clients were not freed"
        time.sleep(0.05)
    assert metric(server, "sparsekv_requests_running") == 0
    check_still_serves(client)


def test_a_client_that_leaves_a_whole_answer_frees_its_row(server, client):
    long = {"model": NAME, "prompt": "y", "max_tokens": MAX_CONTEXT - 1, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=long, timeout=0.5)
    deadline = time.monotonic() + 20
    while metric(server, "sparsekv_free_rows") != MAX_BATCH:
        assert time.monotonic() < deadline, "the row of a disconnected client was not freed"
        time.sleep(0.05)
    assert metric(server, 'sparsekv_finished_requests_total{reason="cancelled"}') > 0
    check_still_serves(client)


def test_stop_strings_hold_back_what_could_start_one():
    stops = StopStrings(["END"])
    assert stops.feed("abcE", False) == ("ab", False)  # "cE" might start END
    assert stops.feed("N", False) == ("c", False)
    assert stops.feed("D!", False) == ("", True)  # END spans three pieces
    assert StopStrings(["zz"]).feed("abz", True) == ("abz", False)


def test_sigterm_finishes_the_running_stream_then_exits(tmp_path):
    """`sparsekv serve` in its own process, on a port the system chooses (`--port 0`), which its banner names once it
    listens: SIGTERM during a stream lets it finish with every token, then the process exits 0 and takes no more
    requests."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sparsekv.cli", "serve", "--model", "tiny:llama", "--method",
                             "dense", "--port", "0", "--max-context", "1024", "--log-level", "warning"],
                            env=env, cwd=root, stderr=subprocess.PIPE, text=True)
    try:
        banner = next((line for line in proc.stderr if line.startswith("sparsekv serve:")), "")
        port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner)
        assert port and int(port.group(1)) > 0, banner
        url = f"http://127.0.0.1:{port.group(1)}"
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": "tiny:llama", "prompt": "a", "max_tokens": 120, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["usage"]["completion_tokens"] == 120
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def fragile():
    """A server without a chat template, whose engine and service a test may break (URL, engine, service)."""
    tokenizer = byte_tokenizer()
    engine = ServingEngine(tiny_model("llama", layers=1, max_positions=1024), build_config("dense"),
                           tokenizer=tokenizer, max_batch=2, max_context=1024, prefill_chunk=64)
    app = create_app(engine, tokenizer, NAME)
    with running(app) as url:
        yield url, engine, app.state.service


def fail_once(target, name: str, error: Exception) -> None:
    """Makes ``target.name`` raise ``error`` at its next call, and be itself again after."""
    def broken(*args, **kwargs):
        delattr(target, name)
        raise error

    setattr(target, name, broken)


def served(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "ok", "max_tokens": 3, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def data(lines) -> list:
    """The JSON of a stream's remaining events (its [DONE] as the string)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_no_chat_template(fragile):
    """Without a chat template, chat is a 400 that says how to give one."""
    url, _, _ = fragile
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user",
                                                                                    "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
    assert "--chat-template" in r.json()["error"]["message"]


def test_a_failing_step_ends_its_requests_with_error_and_the_server_serves_on(fragile):
    """A decode step that raises cannot be laid to one request: the requests it ran end with finish reason "error",
    each told so (an error event in a stream, then [DONE]; a 500 for a whole answer), /metrics counts them, and the
    next requests are answered. So too where ``step`` itself raises."""
    url, engine, _ = fragile
    errors = metric(url, 'sparsekv_finished_requests_total{reason="error"}')
    long = {"model": NAME, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, contextlib.ExitStack() as stack:
        streams = [stack.enter_context(http.stream("POST", url + "/v1/completions", json={**long, "prompt": p}))
                   for p in ("x", "yz")]
        lines = [s.iter_lines() for s in streams]
        for it in lines:  # both run
            next(line for line in it if line.startswith("data: "))
        fail_once(engine.runner, "launch", RuntimeError("device lost"))
        for it in lines:
            events = data(it)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error", events[-3:]
            assert 'finish reason "error"' in events[-2]["error"]["message"]
            assert "RuntimeError: device lost" in events[-2]["error"]["message"]
    assert metric(url, 'sparsekv_finished_requests_total{reason="error"}') == errors + 2
    served(url)
    fail_once(engine.runner, "launch", RuntimeError("device lost"))
    r = httpx.post(url + "/v1/completions", json={**long, "stream": False}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    assert r.json()["error"]["type"] == "server_error" and "device lost" in r.json()["error"]["message"]
    served(url)
    fail_once(engine, "step", RuntimeError("a bug"))  # past the engine's own handling
    r = httpx.post(url + "/v1/completions", json={**long, "stream": False}, timeout=30)
    assert r.status_code == 500 and "a bug" in r.json()["error"]["message"], r.text
    served(url)


def test_a_request_that_fails_fails_alone(fragile):
    """A request whose first token fails ends with "error" (a 500); the one streaming beside it gets every token,
    and the server answers the next."""
    url, engine, _ = fragile
    runner = engine.runner
    first_token = runner.first_token

    def broken(job, *args):
        if job.prompt == [10] * 5:
            raise OverflowError("int too big to convert")
        return first_token(job, *args)

    runner.first_token = broken
    try:
        body = {"model": NAME, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": [10] * 5, "max_tokens": 5},
                           timeout=30)
            assert r.status_code == 500 and "OverflowError: int too big to convert" in r.json()["error"]["message"]
            events = data(lines)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 300
        assert events[-3]["choices"][0]["finish_reason"] == "length"
    finally:
        del runner.first_token
    served(url)


def test_an_unexpected_error_in_a_handler_is_a_json_500(fragile, monkeypatch):
    """An error no handler expected is a 500 in OpenAI's error body, whole or streamed, and the server serves on."""
    url, _, service = fragile

    def broken(body):
        raise ValueError("unexpected")

    monkeypatch.setattr(service, "completion_prompts", broken)
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "internal error: ValueError: unexpected", "type": "server_error", "param": None,
        "code": "internal_error"}
    monkeypatch.undo()

    async def failing(rid, subscriber, stops):
        raise KeyError("lost")
        yield

    monkeypatch.setattr(service, "pieces", failing)
    with httpx.stream("POST", url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2,
                                                             "stream": True}, timeout=30) as stream:
        events = data(stream.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
    assert "KeyError" in events[-2]["error"]["message"]
    monkeypatch.undo()
    served(url)


def test_a_stop_string_end_counts_as_stop_in_the_metrics(server, client):
    """A request cut by a stop string ends with finish reason "stop" in /metrics too (not "cancelled"), and its
    latency is observed."""
    def counts():
        return [metric(server, name) for name in ('sparsekv_finished_requests_total{reason="stop"}',
                                                  'sparsekv_finished_requests_total{reason="cancelled"}',
                                                  "sparsekv_request_latency_seconds_count")]

    text = client.completions.create(model=NAME, prompt="stop here", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    before = counts()
    out = client.completions.create(model=NAME, prompt="stop here", max_tokens=MAX_CONTEXT // 2, temperature=0,
                                    stop=[text[3:5]], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 20
    while counts()[0] == before[0]:  # the engine ends it at its next step
        assert time.monotonic() < deadline, "the request cut by a stop string did not end"
        time.sleep(0.05)
    assert counts() == [before[0] + 1, before[1], before[2] + 1]


@pytest.mark.parametrize("argv, message", [
    (["--method", "quest", "--budget", "0"], "token_budget must be a positive multiple"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: no file"),
    (["--max-batch", "0"], "max_batch"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--max-prompt-tokens", "0"], "max_prompt_tokens"),
    (["--prefix-cache-gib", "1", "--method", "snapkv"], "prefix_cache_bytes must be 0 for snapkv"),
    (["--kv-memory-gib", "0.0000001"], "kv_memory_bytes"),
    (["--kv-memory-gib", "-2"], "--kv-memory-gib must be a number of GiB > 0"),
    (["--method", "lowbit", "--time-slice", "64"],
     "--time-slice must be None for lowbit: its rows cannot go to host memory and back unchanged"),
    (["--method", "raas", "--swap-space-gib", "-1"], "--swap-space-gib must be a number >= 0, got -1.0"),
])
def test_serve_command_errors(argv, message, capsys):
    from sparsekv.cli import main

    assert main(["serve", "--model", "tiny:llama", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_port_out_of_range_is_refused_before_the_model_loads(capsys):
    from sparsekv.cli import main

    with pytest.raises(SystemExit) as exit_code:
        main(["serve", "--model", "/no/such/model", "--port", "70000"])
    assert exit_code.value.code == 2 and "a port from 0 to 65535" in capsys.readouterr().err


def complete(client, prompt, **fields):
    return client.completions.create(model=NAME, prompt=prompt, extra_body={"ignore_eos": True},
                                     **{"max_tokens": 6, **fields})


def test_n_choices_and_lists_of_prompts(roomy):
    greedy = complete(roomy, "abc", temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.prompt_tokens == 3 and greedy.usage.completion_tokens == 18  # a prompt counts once
    sampled = complete(roomy, "abc", temperature=1.0, seed=5, n=2)
    assert sampled.choices[0].text == complete(roomy, "abc", temperature=1.0, seed=5).choices[0].text
    assert sampled.choices[0].text != sampled.choices[1].text  # each choice draws with its own seed
    assert [c.text for c in complete(roomy, "abc", temperature=1.0, seed=5, n=2).choices] == \
        [c.text for c in sampled.choices]
    alone = [complete(roomy, p, temperature=0).choices[0].text for p in ("abc", "xyz")]
    both = complete(roomy, ["abc", "xyz"], temperature=0, n=2)  # prompt by prompt, then choice by choice
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert both.usage.prompt_tokens == 6 and both.usage.completion_tokens == 24
    ids = complete(roomy, [[100, 101], [102]], temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3


def test_streamed_choices_interleave_and_give_the_whole_texts(roomy):
    whole = complete(roomy, ["abc", "hello"], temperature=0, n=2)
    chunks = list(complete(roomy, ["abc", "hello"], temperature=0, n=2, stream=True,
                           stream_options={"include_usage": True}))
    texts = ["", "", "", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_logprobs_whole_streamed_and_cut_by_a_stop_string(roomy):
    out = complete(roomy, "abc", temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the likeliest token, listed first
        assert 1 <= len(top) <= 2 and chosen == pytest.approx(max(top.values())) and chosen <= 0
    streamed = list(complete(roomy, "abc", temperature=0, logprobs=2, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    plain = complete(roomy, "stop here", temperature=0, max_tokens=24).choices[0].text
    cut = complete(roomy, "stop here", temperature=0, max_tokens=24, logprobs=0, stop=[plain[5:7]]).choices[0]
    assert cut.text == plain[:plain.index(plain[5:7])] and cut.finish_reason == "stop"
    assert all(offset < len(cut.text) for offset in cut.logprobs.text_offset)
    assert all(top == {} for top in cut.logprobs.top_logprobs)
    assert complete(roomy, "abc", temperature=0).choices[0].logprobs is None


def test_chat_logprobs(server, roomy):
    messages = [{"role": "user", "content": "Hello"}]
    out = roomy.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert bytes(b for entry in content for b in entry.bytes).decode(errors="replace") == out.choices[0].message.content
    # Each token of this tokenizer is a byte: a lone byte of a character is U+FFFD as text, itself as bytes.
    forced = roomy.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0,
                                           logprobs=True, logit_bias={str(0xC3 + 3): 100},
                                           extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in forced] == [("\ufffd", [0xC3])] * 3
    for fields, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                   "top_logprobs")):
        r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": messages, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_conversations_next_turn_starts_from_the_kept_prompt(server, client, roomy_server, roomy):
    """The server with a prefix cache answers a second turn as the one without, having prefilled only what the first
    turn's prompt and answer did not hold, and says so in ``usage.prompt_tokens_details.cached_tokens``."""
    messages = [{"role": "system", "content": "Read this: " + "the quick brown fox jumps over it. " * 12},
                {"role": "user", "content": "What jumps?"}]
    for turn in range(2):
        answers = [c.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}) for c in (client, roomy)]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        cached = answers[1].usage.prompt_tokens_details.cached_tokens
        assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
        if turn == 0:
            assert cached == 0
            first = answers[1].usage.prompt_tokens
        else:  # the first turn's prompt and its answer but the last token, in whole pages of 16
            assert cached % 16 == 0 and cached == (first + 7) // 16 * 16 and cached > first - 16
        messages += [{"role": "assistant", "content": answers[1].choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    assert metric(roomy_server, "sparsekv_prefix_cache_hits_total") >= 1
    assert metric(roomy_server, "sparsekv_prefix_cache_bytes") > 0


def test_an_api_key_is_asked_of_v1_requests_only():
    tokenizer = byte_tokenizer()
    engine = ServingEngine(tiny_model("llama", layers=2, max_positions=256), build_config("quest", 64),
                           tokenizer=tokenizer, max_batch=1, max_context=256, prefill_chunk=64)
    with running(create_app(engine, tokenizer, NAME, api_key="s3cret")) as url:
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "ok"})  # no key
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(model=NAME, prompt="ok", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(ConfigError, match="api_key"):
        create_app(engine, tokenizer, NAME, api_key="")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_every_choice(roomy_server, roomy, stream):
    long = {"model": NAME, "prompt": ["x", "yz"], "n": 2, "max_tokens": MAX_CONTEXT - 2, "ignore_eos": True,
            "stream": stream}
    if stream:
        with httpx.Client(timeout=30) as http, http.stream("POST", roomy_server + "/v1/completions",
                                                           json=long) as r:
            assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(roomy_server + "/v1/completions", json=long, timeout=0.5)
    deadline = time.monotonic() + 20
    while (metric(roomy_server, "sparsekv_free_rows") != MAX_BATCH or metric(roomy_server, "sparsekv_requests_queued")
           or metric(roomy_server, "sparsekv_requests_running")):
        assert time.monotonic() < deadline, "the choices of a client that left were not all cancelled"
        time.sleep(0.05)
    assert complete(roomy, "ok", temperature=0).usage.completion_tokens == 6


def test_a_long_tokenization_leaves_the_server_answering():
    """Prompts are tokenized off the event loop: while one takes seconds (a sleep stands for a huge prompt's
    tokenization, which releases the GIL as the fast tokenizers do), the server answers others at once."""
    tokenizer = byte_tokenizer()
    engine = ServingEngine(tiny_model("llama", layers=2, max_positions=256), build_config("quest", 64),
                           tokenizer=tokenizer, max_batch=1, max_context=256, prefill_chunk=64)
    app = create_app(engine, tokenizer, NAME)
    service = app.state.service
    tokenize = service.completion_prompts

    def slowly(body):
        time.sleep(2.0)
        return tokenize(body)

    service.completion_prompts = slowly
    with running(app) as url, httpx.Client(timeout=30) as http:
        answered = []
        slow = threading.Thread(target=lambda: answered.append(http.post(
            url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code))
        slow.start()
        time.sleep(0.3)
        began = time.monotonic()
        assert http.get(url + "/health").status_code == 200 and time.monotonic() - began < 1.0
        slow.join()
        assert answered == [200]
