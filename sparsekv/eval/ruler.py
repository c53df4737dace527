"""RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?") that need no external data, with RULER's prompt templates and scoring.

* ``ruler_niah_single_1/2/3``, ``ruler_niah_multikey_1/2/3``, ``ruler_niah_multivalue``, ``ruler_niah_multiquery``:
  "One of the special magic numbers for KEY is: VALUE." needles in a haystack, as RULER's eight NIAH variants
  configure them (haystack: the noise sentences, the essays, or other needles; keys: words or UUIDs; values: 7-digit
  numbers or UUIDs; distractor keys, several values of one key, or several keys asked at once).
* ``ruler_cwe``: common words extraction: a numbered list of words in which 10 occur more often; one worked example
  first, as RULER gives it.
* ``ruler_fwe``: frequent words extraction: coded six-letter words drawn from a Zipf distribution (alpha 2); the
  three most frequent after the top one (shown as ``...``, noise) are asked for.
* Variable tracking is ``vartrack`` in ``synthetic`` (RULER's template, one chain of four hops in noise).

Score: RULER's ``string_match_all`` (the share of the references found in the prediction); every run also records
``part_match`` (RULER's ``string_match_part``: 1 when any reference is found). Needles go to random depths (RULER's
default), so these tasks take no depth axis. Words for keys, and the CWE vocabulary, come from the essays (RULER
draws them from the wonderwords lists, which are not here).
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass

from .base import Sample, TokenFiller, insert_at
from .metrics import string_match, string_match_part
from .synthetic import NOISE, _Synthetic, haystack_files, haystack_text

_NIAH_INTRO = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will "
               "quiz you about the {kind} afterwards.\n")
_NIAH_QUERY = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
_NIAH_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
# Words used as keys (pairs "adjective-noun", as RULER's wonderwords keys): 24 x 24 = 576 distinct keys, enough for
# a haystack made of needles at the model's whole context.
_ADJECTIVES = ("ancient", "bitter", "brave", "calm", "clever", "curious", "damp", "eager", "fancy", "gentle", "grumpy",
               "hollow", "jolly", "lively", "mighty", "nervous", "odd", "proud", "quiet", "rapid", "shiny", "silent",
               "tender", "wicked")
_NOUNS = ("apple", "river", "candle", "marble", "falcon", "violin", "harbor", "pepper", "meadow", "copper", "lantern",
          "orchid", "glacier", "saddle", "thimble", "walnut", "compass", "tunnel", "velvet", "quarry", "badger",
          "kettle", "ribbon", "spider")


@dataclass(frozen=True)
class NiahSpec:
    """One RULER NIAH variant. ``haystack``: "noise" (the repeated sentences), "essay" or "needles" (needles of other
    keys fill the context); ``keys``/``values``: "word" or "uuid" / "number" or "uuid"; ``num_keys``: needles with
    distinct keys (one asked unless ``num_queries`` > 1); ``num_values``: needles per asked key."""

    haystack: str
    keys: str = "word"
    values: str = "number"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1

    def __post_init__(self):
        choices = (("haystack", self.haystack, ("noise", "essay", "needles")), ("keys", self.keys, ("word", "uuid")),
                   ("values", self.values, ("number", "uuid")))
        for name, value, allowed in choices:
            if value not in allowed:
                raise ValueError(f"NiahSpec.{name} must be one of {', '.join(allowed)}, got {value!r}")
        for name in ("num_keys", "num_values", "num_queries"):
            if getattr(self, name) < 1:
                raise ValueError(f"NiahSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_queries > self.num_keys:
            raise ValueError(f"NiahSpec.num_queries ({self.num_queries}) must be <= num_keys ({self.num_keys})")


class _Ruler(_Synthetic):
    """Scored with RULER's all-match; each run also records its part-match."""

    def score(self, sample, prediction):
        return string_match(prediction, sample.answer)

    def run(self, engine, sample):
        result = super().run(engine, sample)
        return {**result, "part_match": string_match_part(result["prediction"], sample.answer)}


class _RulerNiah(_Ruler):
    """A RULER NIAH variant (``spec``). The answer is every value of every asked key."""

    spec: NiahSpec

    def __init__(self, options):
        super().__init__(options)
        self.files = haystack_files(options, self.name) if self.spec.haystack == "essay" else []
        # Values of 7 digits take 7-8 tokens each, UUIDs up to ~36; room for a separator each, as RULER's 128 tokens
        # would be mostly spent on text after the answer.
        per_value = 40 if self.spec.values == "uuid" else 10
        self.max_new_tokens = per_value * self.spec.num_values * self.spec.num_queries + 4

    def filler(self, tokenizer):
        if self.spec.haystack == "essay":
            return TokenFiller(tokenizer, lambda: haystack_text(self.files))
        return TokenFiller(tokenizer, lambda: NOISE)

    def _key(self, rng) -> str:
        if self.spec.keys == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"

    def _value(self, rng) -> str:
        if self.spec.values == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return str(rng.randint(1_000_000, 9_999_999))

    def render(self, rng, filler, n, depth):
        spec, kind = self.spec, "numbers" if self.spec.values == "number" else "uuids"
        keys: list[str] = []
        while len(keys) < spec.num_keys:
            key = self._key(rng)
            keys += [key] if key not in keys else []
        needles = [(key, self._value(rng)) for key in keys for _ in range(spec.num_values)]
        asked = keys[:spec.num_queries]
        if spec.haystack == "needles":
            # The haystack is needles of other keys, as many as n tokens hold (fit_length corrects the count).
            size = len(filler.tokenizer(" " + magic(*needles[0], kind), add_special_tokens=False)["input_ids"])
            distractors = []
            while len(distractors) < n // size:
                key = self._key(rng)
                if key not in keys:
                    distractors.append((key, self._value(rng)))
            placed = [(rng.random(), magic(k, v, kind)) for k, v in needles + distractors]
            text = " ".join(needle for _, needle in sorted(placed))
        else:
            text = insert_at(filler.take(n), [(rng.random(), magic(k, v, kind)) for k, v in needles])
        query = ", ".join(asked[:-1]) + f", and {asked[-1]}" if len(asked) > 1 else asked[0]
        answer = [v for k, v in needles if k in asked]
        question = _NIAH_QUERY.format(kind=kind, query=query) + _NIAH_ANSWER.format(kind=kind, query=query)
        return Sample(_NIAH_INTRO.format(kind=kind) + text, question, answer, self.new_tokens(), {"keys": asked})


def magic(key: str, value: str, kind: str) -> str:
    """RULER's needle: ``One of the special magic numbers for KEY is: VALUE.``"""
    return f"One of the special magic {kind} for {key} is: {value}."


def _niah(name: str, spec: NiahSpec) -> type[_RulerNiah]:
    return type(f"Ruler_{name}", (_RulerNiah,), {"name": f"ruler_{name}", "spec": spec})


NIAH_VARIANTS = (
    _niah("niah_single_1", NiahSpec("noise")),
    _niah("niah_single_2", NiahSpec("essay")),
    _niah("niah_single_3", NiahSpec("essay", values="uuid")),
    _niah("niah_multikey_1", NiahSpec("essay", num_keys=4)),
    _niah("niah_multikey_2", NiahSpec("needles")),
    _niah("niah_multikey_3", NiahSpec("needles", keys="uuid", values="uuid")),
    _niah("niah_multivalue", NiahSpec("essay", num_values=4)),
    _niah("niah_multiquery", NiahSpec("essay", num_keys=4, num_queries=4)),
)


def essay_words(files) -> list[str]:
    """The distinct lower-case words of 4-12 letters in the essays (not parts of contractions), sorted."""
    return sorted(set(re.findall(r"(?<![\w'])[a-z]{4,12}(?![\w'])", haystack_text(files))))


class CommonWords(_Ruler):
    """RULER's common words extraction at lengths below 4K (its short setting): 10 common words 6 times each and
    the others once, shuffled and numbered; a worked example of 20 words (3 times / once) comes first."""

    name = "ruler_cwe"
    max_new_tokens = 64  # ten numbered words; RULER's 120 mostly pays for text after them
    num_common = 10
    context = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
               "the ones that appear most often.\n{}\n")
    question = ("Question: What are the 10 most common words in the above list? Answer: The top 10 words that "
                "appear most often in the list are:")

    def __init__(self, options):
        super().__init__(options)
        self.words = essay_words(haystack_files(options, self.name))

    def _list(self, rng, words: int, common: int) -> tuple[list[str], list[str]]:
        """(the numbered list's items: the first num_common of ``words`` random words ``common`` times each, the
        others once, shuffled; those common words)."""
        chosen = rng.sample(self.words, words)
        items = chosen[:self.num_common] * common + chosen[self.num_common:]
        rng.shuffle(items)
        return items, chosen[:self.num_common]

    def render(self, rng, filler, n, depth):
        example, example_answer = self._list(rng, 20, 3)
        # The n filler tokens are uncommon words, each as many tokens as an item of the example takes.
        per_item = len(filler.tokenizer(" " + numbered(example), add_special_tokens=False)["input_ids"]) / len(example)
        items, answer = self._list(rng, self.num_common + int(n / per_item), 6)
        shot = self.context.format(numbered(example)) + self.question + " " + numbered(example_answer) + "\n"
        return Sample(shot + self.context.format(numbered(items)), self.question, answer, self.new_tokens())


def numbered(words: list[str]) -> str:
    """``1. w1 2. w2 ...``"""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


class FrequentWords(_Ruler):
    """RULER's frequent words extraction: a vocabulary of length / 50 random six-letter words ranked by a Zipf
    distribution (alpha 2.0; word k occurs ``words * k^-2 / zeta(2)`` times); the top word is ``...`` (noise), the
    answer is the words ranked 2 to 4."""

    name = "ruler_fwe"
    max_new_tokens = 24
    alpha = 2.0
    intro = ("Read the following coded text and track the frequency of each coded word. Find the three most "
             "frequently appeared coded words. ")
    question = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text? Answer: According to the coded text above, the "
                "three most frequently appeared words are:")

    def render(self, rng, filler, n, depth):
        vocab: list[str] = ["..."]
        while len(vocab) < max(8, n // 50):  # RULER: length / 50 words
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
            vocab += [word] if word not in vocab else []
        zeta = math.pi ** 2 / 6  # zeta(2)
        words = n // 3  # a coded word is ~3 tokens
        items = [w for k, w in enumerate(vocab, 1) for _ in range(int(words * k ** -self.alpha / zeta))]
        rng.shuffle(items)
        return Sample(self.intro + " ".join(items), self.question, vocab[1:4], self.new_tokens())


RULER = (*NIAH_VARIANTS, CommonWords, FrequentWords)
