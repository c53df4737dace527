"""Generated retrieval tasks, each sized to a token length and reproducible from a seed.

* ``passkey``: the landmark-attention pass key test (Mohtashami & Jaggi, 2023) as Quest evaluates it.
* ``niah``: a magic-number needle in a haystack of real essays (a folder of text files), at a depth.
* ``multikey``: RULER's multi-key needle test: several keyed needles in noise, one asked for.
* ``vartrack``: RULER's variable tracking: a chain of ``VAR X = VAR Y`` assignments spread through noise.
* ``2stage``: after OmniKV's 2StageRetr: a dictionary from numbers to colours and two values spread through noise;
  the answer is the colour of the values' sum. The model writes the two stages out (the values, their sum, then
  that number's colour), so what the second stage must find is known only after the first is decoded: a selection
  made once at prefill cannot anticipate it.
* ``arith``: a long-decode task (the RaaS setting): a short program of arithmetic steps whose written chain of
  intermediate results is longer than the prompt; each step reads its operation from the prompt and earlier
  results from the decode, so both old prompt tokens and recent decode tokens matter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .base import (HAYSTACK_ENV, EvalError, Sample, Task, TokenFiller, data_dir, fit_length, insert_at,
                   read_text_file, sample_rng)
from .metrics import parse_first_int, string_match

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_WORDS = ("apple", "river", "candle", "marble", "falcon", "violin", "harbor", "pepper", "meadow", "copper",
             "lantern", "orchid", "glacier", "saddle", "thimble", "walnut", "compass", "tunnel", "velvet", "quarry")
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "grey",
           "violet", "indigo", "crimson", "teal", "maroon", "olive", "navy", "silver", "gold")


class _Synthetic(Task):
    """A generated task: ``render(rng, filler, n, depth)`` builds a sample with ``n`` filler tokens."""

    lengths = (1024, 2048, 4096)

    def filler(self, tokenizer) -> TokenFiller:
        return TokenFiller(tokenizer, lambda: NOISE)

    def samples(self, tokenizer, length, depth, seed, count):
        filler = self.filler(tokenizer)
        out = []
        for i in range(count):
            rng = sample_rng(seed, self.name, length, depth, i)
            state = rng.getstate()

            def render(n, state=state):
                rng.setstate(state)  # every attempt at the length draws the same sample
                return self.render(rng, filler, n, depth)

            out.append(fit_length(tokenizer, length, render))
        return out

    def render(self, rng, filler: TokenFiller, n: int, depth: float | None) -> Sample:
        raise NotImplementedError

    def score(self, sample, prediction):
        return string_match(prediction, sample.answer)


class Passkey(_Synthetic):
    name = "passkey"
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    max_new_tokens = 12
    intro = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
             "I will quiz you about the important information there.\n")

    def render(self, rng, filler, n, depth):
        key = rng.randint(1, 50000)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        context = self.intro + insert_at(filler.take(n), [(depth, needle)])
        return Sample(context, "\nWhat is the pass key? The pass key is", key, self.new_tokens(), {"passkey": key})

    def score(self, sample, prediction):
        return float(parse_first_int(prediction) == sample.answer)


def magic_needle(key: str, value: int) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def magic_question(key: str) -> str:
    return (f"\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")


_MAGIC_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards.\n")


# The first essays of the shared folder (MIT licence, in data/haystack/LICENSE), about 30K tokens: enough for
# 8K-token haystacks without the shared data, and the same text as it up to their length.
SHIPPED_HAYSTACK = Path(__file__).parent / "data" / "haystack" / "paul_graham_essays"


def haystack_files(options, task: str) -> list[Path]:
    """The essays' ``.txt`` files: ``--haystack-dir``, else ``$SPARSEKV_HAYSTACK_DIR``, else the shared data,
    else the essays the package ships."""
    folder = options.haystack_dir or os.environ.get(HAYSTACK_ENV)
    if not folder:
        shared = data_dir() / "haystack" / "paul_graham_essays"
        folder = shared if any(shared.glob("*.txt")) else SHIPPED_HAYSTACK
    folder = Path(folder)
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise EvalError(f"{task}: no .txt files in haystack folder {folder} (pass --haystack-dir or set "
                        f"{HAYSTACK_ENV})")
    for f in files:  # here, before a model loads: a file that is not text is refused, not scored as U+FFFD
        read_text_file(f, task, "--haystack-dir")
    return files


def haystack_text(files: list[Path]) -> str:
    """The files in name order, whitespace collapsed within each, separated by blank lines."""
    return "\n\n".join(" ".join(f.read_text(encoding="utf-8").split()) for f in files) + "\n\n"


class Niah(_Synthetic):
    name = "niah"
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    max_new_tokens = 16

    def __init__(self, options):
        super().__init__(options)
        self.files = haystack_files(options, self.name)

    def filler(self, tokenizer):
        return TokenFiller(tokenizer, lambda: haystack_text(self.files))

    def render(self, rng, filler, n, depth):
        key, value = rng.choice(KEY_WORDS), rng.randint(1_000_000, 9_999_999)
        context = _MAGIC_INTRO + insert_at(filler.take(n), [(depth, magic_needle(key, value))])
        return Sample(context, magic_question(key), [str(value)], self.new_tokens(), {"key": key})


class MultiKey(_Synthetic):
    name = "multikey"
    max_new_tokens = 16
    num_keys = 4

    def render(self, rng, filler, n, depth):
        keys = rng.sample(KEY_WORDS, self.num_keys)
        values = [rng.randint(1_000_000, 9_999_999) for _ in keys]
        needles = [(rng.random(), magic_needle(k, v)) for k, v in zip(keys, values)]
        asked = rng.randrange(self.num_keys)
        context = _MAGIC_INTRO + insert_at(filler.take(n), needles)
        return Sample(context, magic_question(keys[asked]), [str(values[asked])], self.new_tokens(),
                      {"key": keys[asked], "needle_depth": round(needles[asked][0], 3)})


class VarTrack(_Synthetic):
    name = "vartrack"
    max_new_tokens = 32
    hops = 4

    def render(self, rng, filler, n, depth):
        names = set()
        while len(names) < self.hops + 1:
            names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
        names = list(names)
        rng.shuffle(names)
        value = rng.randint(10000, 99999)
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = sorted(rng.random() for _ in chain)
        context = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                   + insert_at(filler.take(n), list(zip(depths, chain))))
        question = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                    f"Answer: According to the chain(s) of variables assignment in the text above, {len(names)} "
                    f"variables are assigned the value {value}, they are:")
        return Sample(context, question, names, self.new_tokens(), {"value": value})


class TwoStage(_Synthetic):
    """The answer is written as ``The value of X is a. The value of Y is b. X + Y is a + b = s. The color of number
    s is c.`` (``meta["solution"]``): each lookup in the form its fact was stated in, the addition with its
    operands beside it as in ``arith``. The score is 1 when the first colour named is c, so a prediction listing
    colours scores 0."""

    name = "2stage"
    max_new_tokens = 64  # the written answer is ~52 tokens with digits one per token
    entries = 16

    def render(self, rng, filler, n, depth):
        a, b = rng.randint(10, 499), rng.randint(10, 499)
        numbers = {a + b}
        while len(numbers) < self.entries:
            numbers.add(rng.randint(20, 998))
        colours = rng.sample(COLOURS, self.entries)
        table = dict(zip(sorted(numbers, key=lambda _: rng.random()), colours))
        facts = [f"The color of number {k} is {c}." for k, c in table.items()]
        facts += [f"The value of X is {a}.", f"The value of Y is {b}."]
        context = ("Below is a text with hidden facts: colors of numbers and the values of X and Y. "
                   "Memorize them.\n" + insert_at(filler.take(n), [(rng.random(), f) for f in facts]))
        question = ("\nQuestion: What is the color of the number X + Y? Answer step by step: find X and Y, add "
                    "them, then find the color of the sum.\nAnswer:")
        solution = (f" The value of X is {a}. The value of Y is {b}. X + Y is {a} + {b} = {a + b}. "
                    f"The color of number {a + b} is {table[a + b]}.")
        return Sample(context, question, [table[a + b]], self.new_tokens(), {"x": a, "y": b, "solution": solution})

    def score(self, sample, prediction):
        named = [w for w in re.findall(r"[a-z]+", prediction.lower()) if w in COLOURS]
        return float(bool(named) and named[0] == sample.answer[0])


class ArithChain(Task):
    """``lengths`` here are step counts. Step k applies the k-th operation of the prompt modulo 100: ``+a``,
    ``-a``, or ``+rj`` (add the result of an earlier step j, at most ``reach`` steps back). Addition and
    subtraction, not multiplication: a step must be exact 64 times in a row, and a small model learns carries,
    not a 10,000-entry product table; what the task measures is the retrieval of operations and results. The
    model writes ``k: <previous> <op> <operand> = <result>`` per line and ends with ``Answer: <final>``; the score
    is 1 when the final answer is right. ``meta["solution"]`` holds the reference working (training data for the
    project's own model)."""

    name = "arith"
    lengths = (16, 32, 64)
    reach = 8

    def samples(self, tokenizer, length, depth, seed, count):
        if length is None or length < 1:
            raise EvalError(f"arith: --lengths are step counts >= 1, got {length!r}")
        out = []
        for i in range(count):
            rng = sample_rng(seed, self.name, length, i)
            x = rng.randint(0, 99)
            results, ops, lines = [], [], []
            for k in range(1, length + 1):
                prev = results[-1] if results else x
                kind = rng.choice("+-r") if k > 2 else rng.choice("+-")
                if kind == "r":
                    j = rng.randint(max(1, k - self.reach), k - 1)
                    ops.append(f"{k}: +r{j}")
                    value, shown = (prev + results[j - 1]) % 100, f"{prev} + r{j}={results[j - 1]}"
                else:
                    a = rng.randint(2, 99)
                    ops.append(f"{k}: {kind}{a}")
                    value = (prev + a if kind == "+" else prev - a) % 100
                    shown = f"{prev} {kind} {a}"
                results.append(value)
                lines.append(f"{k}: {shown} = {value}")
            solution = "\n".join(lines) + f"\nAnswer: {results[-1]}"
            context = (f"Compute step by step, modulo 100. rj is the result of step j. x = {x}.\nSteps:\n"
                       + "\n".join(ops))
            budget = len(tokenizer(solution, add_special_tokens=False)["input_ids"])
            out.append(Sample(context, "\nWork:\n", results[-1], self.options.new_tokens(budget + budget // 5),
                              {"steps": length, "solution": solution}))
        return out

    def score(self, sample, prediction):
        _, found, tail = prediction.partition("Answer:")
        return float(bool(found) and parse_first_int(tail) == sample.answer)


SYNTHETIC = (Passkey, Niah, MultiKey, VarTrack, TwoStage, ArithChain)
