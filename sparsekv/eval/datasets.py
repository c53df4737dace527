"""Tasks read from files: long-decode reasoning (GSM8K, MATH500, AIME), perplexity of a text, and LongBench."""

from __future__ import annotations

import json
from pathlib import Path

from .base import EvalError, Sample, Task, data_dir, read_text_file, require_path
from .metrics import (answers_match, classification_score, code_similarity, count_score, extract_answer, qa_f1,
                      retrieval_score, rouge_l)


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise EvalError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return rows


def _field(row: dict, names: tuple[str, ...], path: Path) -> str:
    for name in names:
        if name in row:
            return str(row[name])
    raise EvalError(f"{path}: rows need one of the fields {', '.join(names)}; got {', '.join(row)}")


class _Reasoning(Task):
    """Chain-of-thought generation on a jsonl of problems; the final answer is extracted and compared after
    normalisation. Rows: ``question`` or ``problem``, and ``answer`` (GSM8K's ``... #### 18`` is accepted)."""

    metric = "exact match"
    default_samples = None
    folder = ""
    max_new_tokens = 1024
    instruction = "\nPlease reason step by step, and put your final answer within \\boxed{}."

    def __init__(self, options):
        super().__init__(options)
        self.path = require_path(options.data or data_dir() / self.folder / "test.jsonl", f"{self.name} data",
                                 "--data")

    def samples(self, tokenizer, length, depth, seed, count):
        rows = read_jsonl(self.path)[:count]
        out = []
        for i, row in enumerate(rows):
            answer = _field(row, ("answer",), self.path)
            answer = answer.rsplit("####", 1)[1].strip() if "####" in answer else answer
            problem = _field(row, ("question", "problem"), self.path)
            out.append(Sample(problem + self.instruction, "", answer, self.new_tokens(), {"row": i}))
        return out

    def score(self, sample, prediction):
        return float(answers_match(extract_answer(prediction), sample.answer))


class GSM8K(_Reasoning):
    name, folder, max_new_tokens = "gsm8k", "gsm8k", 512


class Math500(_Reasoning):
    name, folder, max_new_tokens = "math500", "math500", 2048


class AIME(_Reasoning):
    name, folder, max_new_tokens = "aime", "aime24", 4096


def held_out_essays() -> list[Path]:
    """The essays the project's model was not trained on (``held_out`` in its ``training_args.json``): the default
    text of the perplexity task, so that it measures language modelling rather than memory. From the shared data's
    haystack folder where it holds them all, else from the package (its haystack, and the held-out essays that the
    haystack lacks)."""
    from ..models import DEFAULT_MODEL
    from .synthetic import SHIPPED_HAYSTACK

    record = require_path(Path(DEFAULT_MODEL) / "training_args.json", "the project's model's training record",
                          "--data")
    names = json.loads(record.read_text())["held_out"]
    for folders in ((data_dir() / "haystack" / "paul_graham_essays",),
                    (SHIPPED_HAYSTACK, SHIPPED_HAYSTACK.parent / "held_out")):
        found = [next((f / name for f in folders if (f / name).is_file()), None) for name in names]
        if all(found):
            return found
    raise EvalError(f"perplexity: the held-out essays ({', '.join(names)}) were not found (pass --data)")


class Perplexity(Task):
    """Perplexity of windows of a text file (or of a folder of .txt files, joined; default: the essays the
    project's model held out from training). The first ``--prefill-tokens`` of each window are prefilled; every
    later token is fed through the decode path, one per step, as PG19-style evaluations of sparse decoding do.
    Length = tokens per window. The files are UTF-8 text, read when the task is made (before any model loads)."""

    name = "perplexity"
    metric = "perplexity"
    lengths = (2048, 4096)
    default_samples = 1

    def __init__(self, options):
        super().__init__(options)
        if options.data:
            path = require_path(options.data, "perplexity text", "--data")
            self.files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
            if not self.files:
                raise EvalError(f"perplexity: no .txt files in {path}")
            self.path = str(path)
        else:
            self.files = held_out_essays()
            self.path = f"the held-out essays ({', '.join(f.name for f in self.files)})"
        self.text = "\n\n".join(read_text_file(f, self.name, "--data") for f in self.files)

    def samples(self, tokenizer, length, depth, seed, count):
        prefill = self.options.prefill_tokens
        if not 0 < prefill < length:
            raise EvalError(f"--prefill-tokens must be between 1 and the length - 1 ({length - 1}), got {prefill} "
                            f"(the default is 1024: give a smaller one for windows of {length} tokens)")
        ids = tokenizer(self.text, add_special_tokens=False)["input_ids"]
        windows = len(ids) // length
        if windows == 0:
            raise EvalError(f"perplexity: {self.path} has {len(ids)} tokens, fewer than the length {length}")
        return [Sample("", "", ids[i * length:(i + 1) * length], 0, {"window": i, "prefill_tokens": prefill})
                for i in range(min(count, windows))]

    def run(self, engine, sample):
        return engine.perplexity(sample.answer, self.options.prefill_tokens)

    def target(self, sample):
        return None  # the window's token ids: no use in the results file


LONGBENCH_METRICS = {
    "narrativeqa": qa_f1, "qasper": qa_f1, "multifieldqa_en": qa_f1, "hotpotqa": qa_f1, "2wikimqa": qa_f1,
    "musique": qa_f1, "triviaqa": qa_f1, "gov_report": rouge_l, "qmsum": rouge_l, "multi_news": rouge_l,
    "samsum": rouge_l, "trec": classification_score, "passage_retrieval_en": retrieval_score,
    "passage_count": count_score, "lcc": code_similarity, "repobench-p": code_similarity,
}
# LongBench's few-shot sets are scored on the first line of the answer, as its official evaluation does.
FIRST_LINE = ("trec", "triviaqa", "samsum")


class LongBench(Task):
    """LongBench (Bai et al., 2023) from a folder of its jsonl files (``<dataset>.jsonl``; fields ``context``,
    ``input``, ``answers``, ``all_classes``), with the official prompt templates and generation lengths
    (``dataset2prompt.json``, ``dataset2maxlen.json`` in ``--longbench-dir``). Contexts longer than the length
    lose their middle. The template's text after ``{context}`` is the question. English datasets only (the
    Chinese ones are scored on jieba words)."""

    name = "longbench"
    metric = "score"
    lengths = (4096,)
    default_samples = None

    def __init__(self, options):
        super().__init__(options)
        if not options.data:
            raise EvalError("longbench needs --data: a folder of LongBench jsonl files (e.g. narrativeqa.jsonl)")
        self.folder = require_path(options.data, "LongBench data folder", "--data")
        templates = Path(options.longbench_dir or data_dir() / "longbench")
        self.prompts = json.loads(require_path(templates / "dataset2prompt.json", "LongBench templates",
                                               "--longbench-dir").read_text())
        self.maxlens = json.loads(require_path(templates / "dataset2maxlen.json", "LongBench generation lengths",
                                               "--longbench-dir").read_text())
        names = options.datasets or tuple(sorted(p.stem for p in self.folder.glob("*.jsonl")
                                                 if p.stem in LONGBENCH_METRICS))
        if not names:
            raise EvalError(f"longbench: no supported dataset files in {self.folder} (supported: "
                            f"{', '.join(LONGBENCH_METRICS)})")
        for name in names:
            if name not in LONGBENCH_METRICS:
                raise EvalError(f"longbench dataset {name!r} is not supported; supported: "
                                f"{', '.join(LONGBENCH_METRICS)}")
            require_path(self.folder / f"{name}.jsonl", f"LongBench file for {name}", "--data")
        self.datasets = names

    def samples(self, tokenizer, length, depth, seed, count):
        out = []
        specials = len(tokenizer("", add_special_tokens=True)["input_ids"])  # e.g. BOS, added to the context
        for name in self.datasets:
            template = self.prompts[name]
            head, tail = template.split("{context}", 1)
            path = self.folder / f"{name}.jsonl"
            for i, row in enumerate(read_jsonl(path)[:count]):
                missing = [k for k in ("context", "answers") if k not in row]
                if missing:
                    raise EvalError(f"{path}: row {i + 1} has no field {', '.join(missing)} (LongBench rows hold "
                                    f"context, input, answers, all_classes); got {', '.join(row)}")
                fields = {"context": row["context"], "input": row.get("input", "")}
                question = tail.format(**fields)
                q_tokens = len(tokenizer(question, add_special_tokens=False)["input_ids"])
                context = _truncate_middle(tokenizer, head.format(**fields) + row["context"],
                                           length - q_tokens - specials)
                answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
                out.append(Sample(context, question, {"answers": answers, "classes": row.get("all_classes")},
                                  self.options.new_tokens(self.maxlens[name]),
                                  {"dataset": name, "row": i}))
        return out

    def score(self, sample, prediction):
        name = sample.meta["dataset"]
        if name in FIRST_LINE:
            prediction = prediction.lstrip("\n").split("\n")[0]
        metric = LONGBENCH_METRICS[name]
        if metric is classification_score:
            return max(metric(prediction, a, sample.answer["classes"]) for a in sample.answer["answers"])
        return max(metric(prediction, a) for a in sample.answer["answers"])


def _truncate_middle(tokenizer, text: str, max_tokens: int) -> str:
    """``text`` without the middle tokens beyond ``max_tokens``, as LongBench truncates."""
    if max_tokens < 2:
        raise EvalError(f"longbench: length leaves {max_tokens} tokens for the context; use a larger --lengths")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[len(ids) - (max_tokens - half):])


DATASETS = (GSM8K, Math500, AIME, Perplexity, LongBench)
