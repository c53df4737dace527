"""``sparsekv demo``'s decode speed: every method decodes at least ``DEMO_TIMED_STEPS`` steps, past its answer, and
its tokens/s is one over the median step; the answer is still cut at EOS and --max-new-tokens; the notes say why
attended exceeds the budget and why the CPU shows no speed-up."""

import re
import statistics

from sparsekv import cli
from sparsekv.cli import DEMO_TIMED_STEPS, GenerationResult, main


def test_decode_speed_is_one_over_the_median_step():
    steps = [0.01] * 40 + [5.0] * 3 + [0.02] * 20  # a few steps slowed by other work on the machine
    result = GenerationResult(text="", tokens=list(range(64)), prompt_tokens=10, prefill_seconds=1.0,
                              decode_seconds=sum(steps), stats={}, kv_held_bytes=0, kv_allocated_bytes=0,
                              offloaded_bytes=0, step_seconds=steps)
    assert result.decode_tokens_per_second == 1 / statistics.median(steps) == 100.0
    untimed = GenerationResult(**{**result.__dict__, "step_seconds": None})
    assert untimed.decode_tokens_per_second == 63 / sum(steps)


def test_demo_times_enough_steps_and_cuts_the_answer(monkeypatch, capsys):
    runs = []
    real = cli.generate

    def spy(model, tokenizer, config, prompt, max_new_tokens, **kwargs):
        result = real(model, tokenizer, config, prompt, max_new_tokens, **kwargs)
        runs.append((config.name, max_new_tokens, kwargs, result))
        return result

    monkeypatch.setattr(cli, "generate", spy)
    assert main(["demo", "--model", "tiny:llama", "--method", "quest", "--prompt-tokens", "300",
                 "--max-new-tokens", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    timed = runs[1:]  # after the warm-up
    assert [name for name, *_ in timed] == ["dense", "quest"]
    for name, new_tokens, kwargs, result in timed:
        assert new_tokens == DEMO_TIMED_STEPS and kwargs["time_steps"] and kwargs["stop_tokens"] == []
        assert len(result.tokens) == DEMO_TIMED_STEPS and len(result.step_seconds) == DEMO_TIMED_STEPS - 1
        speed = re.search(rf"\| {name} \| [^|]+ \| [^|]* \| [\d.]+ \| ([\d.]+) \|", out).group(1)
        assert speed == f"{1 / statistics.median(result.step_seconds):.1f}"
    assert "| first 3 of 3 |" in out  # the answer: --max-new-tokens of the timed tokens
    assert f"over {DEMO_TIMED_STEPS} steps" in out
    assert "OmniKV's filter layers attend the whole context, RaaS keeps the prompt" in out
    assert "On the CPU the sparse methods gain little over dense, or lose" in out


def test_demo_answer_ends_at_eos():
    assert cli._answer([5, 7, 2, 9, 9], {2}, 48) == [5, 7, 2]
    assert cli._answer([5, 7, 2, 9, 9], {2}, 2) == [5, 7]
    assert cli._answer([5, 7, 9], {2, 3}, 48) == [5, 7, 9]
