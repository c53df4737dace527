"""Training data of the project's model: the tokenizer, the essays split and the task mixture.

Every batch is a function of (seed, batch index) alone, so it is the same whatever the number of DataLoader
workers, and a run can be reproduced from its seed. A batch holds ``tokens_per_step // L`` rows of exactly ``L``
tokens (no padding, so attention is plain causal SDPA); ``L`` follows a curriculum from ``min_len`` to ``context``.
A row is one of:

* a retrieval task (passkey, multikey, vartrack, 2stage) drawn by the harness's own generator at a prompt length
  between L/2 and L - 64, followed by its answer and ``</s>``; the rest of the row is essay text;
* arithmetic chains (the harness's ``arith``: prompt, ``Work:``, the reference working ``meta["solution"]``,
  ``</s>``), packed one after another, the rest essay text;
* dense recall: facts in the tasks' own sentence forms (magic numbers, colours of numbers, values of letters, a
  pass key) among noise sentences, each restated or asked again later in the row, at every distance, with the
  recalled value as answer. A retrieval row has one answer; a recall row has dozens, so retrieval heads get a
  gradient from every row (MQAR-style associative recall). It also fills the rest of task and arith rows;
* essay text (plain language modelling on the training split), kept to a small share: the training split is only
  165K tokens, so every essay row is another epoch over it.

Per token the batch carries ``answer`` (True on the answer/working tokens and their ``</s>``) and ``lm_weight`` (the
weight of the token in the language-modelling term: 1 on essay text, ``prompt_weight`` on task prompts, 0 on answer
tokens and on each document's ``<s>``). Why two terms: an 8K passkey row has about 5 answer tokens among 8000 prompt
tokens, so a single token-averaged loss would give the answers a thousandth of the gradient. The answer term is the
mean answer NLL per task row (each sample counts the same, short passkey answers as much as long arithmetic
workings); the prompt keeps a small weight because predicting it teaches the format and local copying (the needle
repeats its key) at little cost, since the filler is nearly free to predict.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsekv.eval.base import EvalError, TaskOptions, data_dir, encode
from sparsekv.eval.synthetic import COLOURS, KEY_WORDS, NOISE, magic_needle, magic_question
from sparsekv.eval.tasks import get_task

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
RETRIEVAL = ("passkey", "multikey", "vartrack", "2stage")
GENERATED = RETRIEVAL + ("arith",)  # row kinds drawn by the harness's task generators
KINDS = GENERATED + ("recall", "essays")
DEFAULT_MIX = {"passkey": 0.15, "multikey": 0.15, "vartrack": 0.1, "2stage": 0.2, "arith": 0.2, "recall": 0.15,
               "essays": 0.05}
RECALL_INTRO = "Memorize the facts hidden in the following text. Some of them are asked again later.\n"
NOISE_SENTENCES = tuple(" " + x.strip() + "." for x in NOISE.split(".") if x.strip())
ANSWER_RESERVE = 64  # tokens left after a retrieval prompt for its answer and </s>
ARITH_MIN_STEPS, ARITH_MAX_STEPS = 8, 96


def essays_dir(path: str | None = None) -> Path:
    """The essays folder: ``path``, else ``$SPARSEKV_DATA_DIR/haystack/paul_graham_essays`` (default
    ``../shared/data`` from the repo root)."""
    folder = Path(path) if path else data_dir() / "haystack" / "paul_graham_essays"
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"--essays: no .txt files in {folder} (pass --essays or set SPARSEKV_DATA_DIR)")
    return folder


def split_essays(folder: Path, held_out: int) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): ``held_out`` essays evenly spaced in name order are kept for perplexity."""
    files = sorted(folder.glob("*.txt"))
    if not 0 <= held_out < len(files):
        raise ValueError(f"--held-out must be in [0, {len(files) - 1}] for {len(files)} essays, got {held_out}")
    stride = len(files) // held_out if held_out else 0
    held = files[stride // 2::stride][:held_out] if held_out else []
    return [f for f in files if f not in held], held


def read_essay(path: Path) -> str:
    return path.read_text(errors="replace").strip()


def answer_text(task: str, sample) -> str:
    """What the model should generate after a task's question, in the form the harness scores."""
    if "solution" in sample.meta:  # arith and 2stage write their working
        return sample.meta["solution"]
    if task == "passkey":
        return f" {sample.answer}."
    if task == "vartrack":
        return " " + " ".join(sample.answer)
    return f" {sample.answer[0]}."


def tokenizer_corpus(essays: list[Path], samples_per_task: int = 24, seed: int = 0) -> list[str]:
    """Texts the tokenizer is trained on: the training essays and generated task text (prompts and answers),
    generated with the byte tokenizer since the real one does not exist yet."""
    from sparsekv.tiny import byte_tokenizer

    byte_tok = byte_tokenizer()
    texts = [read_essay(f) for f in essays]
    for name in GENERATED:
        task = get_task(name, TaskOptions())
        length = 24 if name == "arith" else 2048
        for s in task.samples(byte_tok, length, 0.5, f"tokenizer{seed}", samples_per_task):
            texts.append(s.context + s.question + answer_text(name, s))
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, out: Path | str):
    """A byte-level BPE tokenizer (digits split one per token, as Llama does, so numbers are spelled the same
    wherever they occur) with ``<pad> <s> </s>`` at ids 0, 1, 2 and ``<s>`` prepended to every encoding. Saved in
    ``out`` so ``AutoTokenizer.from_pretrained(out)`` loads it offline; returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    Path(out).mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out, local_files_only=True)


@dataclass
class Doc:
    """Token ids of one document with per-token answer flags and LM weights (see the module docstring)."""

    ids: list[int]
    answer: list[bool]
    lm_weight: list[float]


def task_doc(tokenizer, task: str, sample, prompt_weight: float) -> Doc:
    """A task sample as the harness feeds it (context with ``<s>``, question) followed by its answer and ``</s>``,
    each part tokenized separately as the harness does, so the answer tokens are the ones the model generates."""
    ctx, question = encode(tokenizer, sample.context, sample.question)
    ans = tokenizer(answer_text(task, sample), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = len(ctx) + len(question)
    return Doc(ctx + question + ans, [False] * prompt + [True] * len(ans),
               [0.0] + [prompt_weight] * (prompt - 1) + [0.0] * len(ans))


class Mixture:
    """Batches of the training mixture; ``batch(index)`` depends only on (seed, index).

    ``weights``: row kind -> probability (KINDS); ``essay_ids``: the tokenized training essays, each document
    ``<s> text </s>``, concatenated; lengths double from ``min_len`` up to ``context`` (the last bucket is
    ``context`` itself); the largest length allowed grows over the first ``curriculum_steps`` batches, and each
    batch takes that largest length half of the time, else a uniformly chosen shorter one."""

    def __init__(self, tokenizer, essay_ids: list[int], *, seed: int, context: int, min_len: int,
                 tokens_per_step: int, curriculum_steps: int, weights: dict[str, float] | None = None,
                 prompt_weight: float = 0.1):
        weights = dict(DEFAULT_MIX if weights is None else weights)
        unknown = sorted(set(weights) - set(KINDS))
        if unknown or not weights or min(weights.values()) < 0 or sum(weights.values()) <= 0:
            raise ValueError(f"mixture weights must be non-negative, not all zero, over {', '.join(KINDS)}; "
                             f"got {weights}")
        if not 0 < min_len <= context:
            raise ValueError(f"min_len must be in (0, context={context}], got {min_len}")
        if len(essay_ids) <= context:
            raise ValueError(f"the training essays hold {len(essay_ids)} tokens, fewer than one row of {context}")
        self.tokenizer, self.essay_ids, self.seed = tokenizer, essay_ids, seed
        self.context, self.tokens_per_step, self.curriculum_steps = context, tokens_per_step, curriculum_steps
        self.kinds, self.weights = list(weights), list(weights.values())
        self.prompt_weight = prompt_weight
        self.buckets = []
        length = min_len
        while length < context:
            self.buckets.append(length)
            length *= 2
        self.buckets.append(context)
        self.tasks = {name: get_task(name, TaskOptions()) for name in GENERATED}

    def row_length(self, index: int) -> int:
        rng = random.Random(f"{self.seed}:length:{index}")
        top = min(len(self.buckets) - 1, index * len(self.buckets) // max(1, self.curriculum_steps))
        return self.buckets[top] if rng.random() < 0.5 else self.buckets[rng.randint(0, top)]

    def batch(self, index: int) -> dict:
        """``input_ids`` (B, L) long, ``answer`` (B, L) bool, ``lm_weight`` (B, L) float32, ``kind`` list of B row
        kinds, ``index``."""
        length = self.row_length(index)
        rows = max(1, self.tokens_per_step // length)
        rng = random.Random(f"{self.seed}:batch:{index}")
        kinds = rng.choices(self.kinds, self.weights, k=rows)
        docs = [self.row(kind, length, f"train{self.seed}:{index}:{r}", rng) for r, kind in enumerate(kinds)]
        return {"input_ids": torch.tensor([d.ids for d in docs]),
                "answer": torch.tensor([d.answer for d in docs]),
                "lm_weight": torch.tensor([d.lm_weight for d in docs], dtype=torch.float32),
                "kind": kinds, "index": index}

    def row(self, kind: str, length: int, seed: str, rng: random.Random) -> Doc:
        """One row of exactly ``length`` tokens: the task documents of ``kind``, then a recall document (essay
        rows: essay text only)."""
        if kind == "essays":
            return self._essay(length, rng)
        docs = []
        if kind in RETRIEVAL:
            docs.append(self._retrieval(kind, length, seed, rng))
        elif kind == "arith":
            docs = self._arith(length, seed, rng)
        used = sum(len(d.ids) for d in docs)
        docs.append(self._recall(length - used, rng))
        return Doc([t for d in docs for t in d.ids], [a for d in docs for a in d.answer],
                   [w for d in docs for w in d.lm_weight])

    def _retrieval(self, kind: str, length: int, seed: str, rng: random.Random) -> Doc:
        task = self.tasks[kind]
        top = length - ANSWER_RESERVE
        # Depths 0 and 1 are the hardest and evaluated, so they get extra weight.
        depth = rng.choice((0.0, 1.0)) if rng.random() < 0.2 else rng.random()
        for target in (rng.randint(length // 2, top), top):
            try:
                sample = task.samples(self.tokenizer, target, depth, seed, 1)[0]
                break
            except EvalError:
                continue  # too short for this task's fixed text: try the longest prompt the row allows
        else:
            raise ValueError(f"rows of {length} tokens are too short for task {kind}; raise --min-len")
        doc = task_doc(self.tokenizer, kind, sample, self.prompt_weight)
        if len(doc.ids) > length:
            raise ValueError(f"{kind} sample of {len(doc.ids)} tokens does not fit a row of {length}")
        return doc

    def _arith(self, length: int, seed: str, rng: random.Random) -> list[Doc]:
        """Arithmetic chains packed until the next one would not fit (at least one; steps halved until it fits)."""
        docs, used = [], 0
        for i in itertools.count():
            steps = rng.randint(ARITH_MIN_STEPS, ARITH_MAX_STEPS)
            doc = self._arith_doc(steps, f"{seed}:{i}")
            while not docs and len(doc.ids) > length and steps > 1:
                steps //= 2
                doc = self._arith_doc(steps, f"{seed}:{i}")
            if used + len(doc.ids) > length:
                if not docs:
                    raise ValueError(f"rows of {length} tokens are too short for one arith chain; raise --min-len")
                return docs
            docs.append(doc)
            used += len(doc.ids)

    def _arith_doc(self, steps: int, seed: str) -> Doc:
        sample = self.tasks["arith"].samples(self.tokenizer, steps, None, seed, 1)[0]
        return task_doc(self.tokenizer, "arith", sample, self.prompt_weight)

    def _essay(self, n: int, rng: random.Random) -> Doc:
        """``n`` tokens of essay text from a random offset."""
        start = rng.randint(0, len(self.essay_ids) - n)
        return Doc(self.essay_ids[start:start + n], [False] * n, [1.0] * n)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _recall(self, n: int, rng: random.Random) -> Doc:
        """``n`` tokens of dense recall: ``<s>``, an intro, then noise sentences, new facts and recalls of earlier
        facts (a restatement or the harness's question, the value being the answer). Every value is random, so a
        recalled one can only be predicted by finding its fact. Each part is tokenized on its own (parts start
        with a space or a newline, which the pre-tokenizer splits at anyway)."""
        ids = [self.tokenizer.bos_token_id] + self._encode(RECALL_INTRO)
        answer, weight = [False] * len(ids), [0.0] + [self.prompt_weight] * (len(ids) - 1)
        facts, used, letters = [], set(), []
        while len(ids) < n:
            r = rng.random()
            if facts and r < 0.3:
                parts = rng.choice(rng.choice(facts)[1])
            elif r < 0.55:
                statement, recalls = _new_fact(rng, used, letters)
                facts.append((statement, recalls))
                parts = [(statement, "")]
            else:
                parts = [(rng.choice(NOISE_SENTENCES), "")]
            for text, value in parts:
                for piece, is_answer in ((text, False), (value, True)):
                    if piece:
                        t = self._encode(piece)
                        ids += t
                        answer += [is_answer] * len(t)
                        weight += [0.0 if is_answer else self.prompt_weight] * len(t)
        return Doc(ids[:n], answer[:n], weight[:n])


def _new_fact(rng: random.Random, used: set, letters: list) -> tuple[str, list[list[tuple[str, str]]]]:
    """A new fact of a recall document: (its statement, its recall forms); a recall form is a list of (prompt text,
    answer text) parts. Keys are unique within the document (``used``); ``letters`` collects the (letter, value)
    facts so far. Sentence forms are the harness's
    (``sparsekv.eval.synthetic``): magic numbers (multikey), colours of numbers and values of letters (2stage,
    with the sum of two letters as a second hop), the pass key."""
    r = rng.random()
    if r < 0.35:
        key = rng.choice(KEY_WORDS) if rng.random() < 0.5 else "".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                                                                       for _ in range(rng.randint(4, 8)))
        if key not in used:
            used.add(key)
            value = f" {rng.randint(1_000_000, 9_999_999)}"
            prefix = magic_needle(key, 0)[:-len(" 0.")]
            return (" " + magic_needle(key, value.strip()),
                    [[(" " + prefix, value), (".", "")], [(magic_question(key), value), (".", "")]])
    elif r < 0.65:
        number = rng.randint(20, 998)
        if ("n", number) not in used:
            used.add(("n", number))
            colour = " " + rng.choice(COLOURS)
            return (f" The color of number {number} is{colour}.",
                    [[(f" The color of number {number} is", colour), (".", "")],
                     [(f"\nQuestion: What is the color of the number {number}? Answer: The color of the number "
                       f"{number} is", colour), (".", "")]])
    elif r < 0.9:
        letter = rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        if letter not in used:
            used.add(letter)
            value = rng.randint(10, 499)
            recalls = [[(f" The value of {letter} is", f" {value}"), (".", "")],
                       [(f"\nQuestion: What is the value of {letter}? Answer: The value of {letter} is",
                         f" {value}"), (".", "")]]
            statement = f" The value of {letter} is {value}."
            for other, other_value in letters:
                total = other_value + value
                written = f" {other_value} + {value} = {total}"  # the sum as 2stage writes it
                recalls.append([(f"\nQuestion: What is {other} + {letter}? Answer: {other} + {letter} is", written),
                                (".", "")])
                if ("n", total) not in used and rng.random() < 0.5:
                    # 2stage's second hop: the colour of the sum, stated with the letter and asked by the letters
                    used.add(("n", total))
                    colour = " " + rng.choice(COLOURS)
                    statement += f" The color of number {total} is{colour}."
                    # asked as 2stage asks, answered as it answers: each stage written out
                    recalls.append([(f"\nQuestion: What is the color of the number {other} + {letter}? Answer: "
                                     f"The value of {other} is", f" {other_value}"),
                                    (f". The value of {letter} is", f" {value}"),
                                    (f". {other} + {letter} is", written),
                                    (f". The color of number {total} is", colour), (".", "")])
            letters.append((letter, value))
            return (statement, recalls)
    elif "pass key" not in used:
        used.add("pass key")
        key = rng.randint(1, 50000)
        return (f" The pass key is {key}. Remember it. {key} is the pass key.",
                [[("\nWhat is the pass key? The pass key is", f" {key}"), (".", "")]])
    return _new_fact(rng, used, letters)  # the key was taken: draw again


def tokenize_essays(tokenizer, files: list[Path]) -> list[int]:
    """``<s> text </s>`` of every file, concatenated."""
    ids = []
    for f in files:
        ids += tokenizer(read_essay(f))["input_ids"] + [tokenizer.eos_token_id]
    return ids


class Stream(torch.utils.data.IterableDataset):
    """Batches ``start, start+1, ..., stop-1`` of a Mixture in order; DataLoader worker ``w`` of ``n`` makes the
    batches with ``index % n == w``, and the DataLoader takes workers in turn, so the order is the index order."""

    def __init__(self, mixture: Mixture, start: int, stop: int):
        self.mixture, self.start, self.stop = mixture, start, stop

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for index in range(self.start + worker, self.stop, workers):
            yield self.mixture.batch(index)
