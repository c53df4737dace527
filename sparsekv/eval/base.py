"""What every task shares: a sample, the task interface, prompt fitting to a token length, and data paths."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_ENV = "SPARSEKV_DATA_DIR"
HAYSTACK_ENV = "SPARSEKV_HAYSTACK_DIR"


class EvalError(Exception):
    """A problem with the user's request (missing file, unknown name, context too long): shown without a
    traceback by the CLI."""


def read_text_file(path: Path, task: str, option: str) -> str:
    """The text of a UTF-8 file. A file that is not one (binary, or in another encoding) is an EvalError naming it
    and ``option``: read leniently, its bytes would be scored as the U+FFFD characters they decode to."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise EvalError(f"{task}: cannot read {path} ({e.strerror or e}); {option} takes UTF-8 text files") from None
    if b"\x00" in data:
        raise EvalError(f"{task}: {path} is a binary file (a NUL byte at offset {data.index(0)}), not text; {option} "
                        f"takes UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalError(f"{task}: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        f"{option} takes UTF-8 text") from None


def data_dir() -> Path:
    """The shared read-only data folder: ``$SPARSEKV_DATA_DIR``, else ``../shared/data`` from the repo root."""
    return Path(os.environ.get(DATA_ENV) or REPO_ROOT.parent / "shared" / "data")


def require_path(path: Path | str, what: str, option: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise EvalError(f"{what} not found: {path} (pass {option} or set {DATA_ENV})")
    return path


@dataclass
class Sample:
    """One prompt. ``context`` is prefilled; ``question`` follows it, fed token by token through the decode path
    (so the sparse method sees it) unless the runner is told to prefill it too. ``answer`` is what ``score``
    compares the generation with; ``meta`` is recorded with the result."""

    context: str
    question: str
    answer: object
    max_new_tokens: int
    meta: dict = field(default_factory=dict)


@dataclass
class TaskOptions:
    """User inputs tasks may need; each task checks the ones it uses when it is built."""

    haystack_dir: str | None = None
    data: str | None = None
    datasets: tuple[str, ...] = ()
    longbench_dir: str | None = None
    max_new_tokens: int | None = None
    prefill_tokens: int = 1024

    def __post_init__(self):
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise ConfigError("--max-new-tokens", "an integer >= 1 (or unset: the task's own)", self.max_new_tokens)
        if not isinstance(self.prefill_tokens, int) or self.prefill_tokens < 1:
            raise ConfigError("--prefill-tokens", "an integer >= 1", self.prefill_tokens)

    def new_tokens(self, default: int) -> int:
        """Tokens to generate: ``--max-new-tokens`` where given, else the task's ``default``."""
        return default if self.max_new_tokens is None else self.max_new_tokens


class Task:
    """A benchmark. ``lengths``/``depths`` say whether those grid axes mean something for it (None: the task
    takes none) and give their defaults; ``metric`` names what ``score`` returns (in [0, 1] unless it is a
    perplexity, where lower is better)."""

    name: str = ""
    metric: str = "accuracy"
    lengths: tuple[int, ...] | None = None
    depths: tuple[float, ...] | None = None
    default_samples: int | None = 5  # samples per grid cell; None = the whole dataset
    max_new_tokens: int = 32

    def __init__(self, options: TaskOptions):
        self.options = options

    def new_tokens(self) -> int:
        return self.options.new_tokens(self.max_new_tokens)

    def samples(self, tokenizer, length: int | None, depth: float | None, seed: int, count: int | None) -> list[Sample]:
        raise NotImplementedError

    def score(self, sample: Sample, prediction: str) -> float:
        raise NotImplementedError

    def target(self, sample: Sample):
        """What the results file records as the expected answer."""
        return sample.answer

    def run(self, engine, sample: Sample) -> dict:
        """Runs one sample with ``engine`` (see ``engine.Engine``); returns the fields recorded for it."""
        gen = engine.generate(sample)
        return {"score": self.score(sample, gen["prediction"]), **gen}


def sample_rng(seed: int, *parts) -> random.Random:
    """A generator that depends only on the seed and the sample's coordinates, so every method and budget sees
    the same sample and a resumed run regenerates it exactly."""
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def encode(tokenizer, context: str, question: str, special: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of the context (with the tokenizer's special tokens unless ``special`` is False, e.g. for text
    a chat template already wrapped) and of the question (without)."""
    ctx = tokenizer(context, add_special_tokens=special)["input_ids"]
    q = tokenizer(question, add_special_tokens=False)["input_ids"] if question else []
    return ctx, q


def count_tokens(tokenizer, sample: Sample) -> int:
    ctx, q = encode(tokenizer, sample.context, sample.question)
    return len(ctx) + len(q)


class TokenFiller:
    """Filler text cut at a token count. ``source()`` returns a text that is repeated as often as needed."""

    def __init__(self, tokenizer, source: Callable[[], str]):
        self.tokenizer = tokenizer
        self.unit = source()
        self.ids: list[int] = []
        self.chars = 4096

    def take(self, n: int) -> str:
        """The text of the first ``n`` tokens of the (repeated) filler."""
        # Only a prefix long enough for n tokens is tokenized (the one token cut at its end is never used).
        while len(self.ids) <= n:
            self.chars *= 2
            text = self.unit * -(-self.chars // len(self.unit))
            self.ids = self.tokenizer(text[:self.chars], add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(self.ids[:n]) if n > 0 else ""


def fit_length(tokenizer, target: int, render: Callable[[int], Sample]) -> Sample:
    """The sample ``render(n)`` whose token count (context + question) is closest to ``target``, ``n`` being the
    filler tokens. Token counts are nearly additive, so a few corrections converge."""
    base = count_tokens(tokenizer, render(0))
    if base > target:
        raise EvalError(f"length {target} is too short for this task: its prompt without filler already takes "
                        f"{base} tokens")
    n, best = target - base, None
    for _ in range(8):
        sample = render(n)
        sample.meta["prompt_tokens"] = got = count_tokens(tokenizer, sample)
        if best is None or abs(got - target) < abs(best.meta["prompt_tokens"] - target):
            best = sample
        if got == target:
            break
        n = max(0, n + target - got)
    return best


def insert_at(text: str, needles: list[tuple[float, str]]) -> str:
    """``text`` with each ``(depth, needle)`` inserted at that depth (0 = start, 1 = end), moved back to the end of
    a sentence, or to the start when no sentence ends before it (never inside a word), as the needle-in-a-haystack
    test does. Needles at equal depths keep their order."""
    cuts = []
    for depth, needle in needles:
        cut = int(round(depth * len(text)))
        if 0 < cut < len(text):
            cut = text.rfind(". ", 0, cut) + 1
        cuts.append(cut)
    out, prev = [], 0
    for cut, (_, needle) in sorted(zip(cuts, needles), key=lambda x: x[0]):
        out += [text[prev:cut], f" {needle} "]
        prev = cut
    return "".join(out) + text[prev:]
