"""Scores of model outputs against references, each in [0, 1].

The LongBench metrics follow the definitions of its official ``metrics.py`` (QA F1 over normalised words, ROUGE-L
F1 over words, classification / retrieval / count accuracy, edit similarity for code), written here so that no
extra package is needed. Reasoning answers are extracted from ``\\boxed{...}`` or ``#### x`` and compared after
normalisation (numbers numerically).
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_text(s: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in string.punctuation)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def qa_f1(prediction: str, reference: str) -> float:
    """Word-overlap F1 of the normalised strings."""
    pred, ref = normalize_text(prediction).split(), normalize_text(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a, b) -> int:
    """Length of the longest common subsequence of two sequences (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, 1):
            keep = row[j]
            row[j] = prev_diag + 1 if x == y else max(row[j], row[j - 1])
            prev_diag = keep
    return row[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace words."""
    pred, ref = prediction.lower().split(), reference.lower().split()
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def classification_score(prediction: str, reference: str, all_classes: list[str]) -> float:
    """LongBench's class accuracy: the class names found in the prediction (dropping those that are part of the
    reference's name); 1 / (number found) if the reference is among them, else 0."""
    found = [c for c in all_classes if c in prediction]
    found = [c for c in found if not (c in reference and c != reference)]
    return 1.0 / len(found) if reference in found else 0.0


def retrieval_score(prediction: str, reference: str) -> float:
    """LongBench passage retrieval: the share of numbers in the prediction that equal the paragraph number."""
    target = re.findall(r"Paragraph (\d+)", reference)
    numbers = re.findall(r"\d+", prediction)
    if not target or not numbers:
        return 0.0
    return sum(n == target[0] for n in numbers) / len(numbers)


def count_score(prediction: str, reference: str) -> float:
    """LongBench passage count: the share of numbers in the prediction that equal the reference."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(reference) for n in numbers) / len(numbers) if numbers else 0.0


def code_similarity(prediction: str, reference: str) -> float:
    """Edit similarity (insert/delete distance ratio, as fuzzywuzzy's ``ratio`` / 100) of the first code line of
    the prediction, skipping comment and fence lines, with the reference."""
    lines = [ln for ln in prediction.lstrip("\n").split("\n") if not ln.strip().startswith(("`", "#", "//"))]
    line = lines[0] if lines else ""
    total = len(line) + len(reference)
    return 2 * lcs_length(line, reference) / total if total else 1.0


def string_match(prediction: str, references: list[str]) -> float:
    """Fraction of the references that occur in the prediction (case-insensitive); RULER's string_match_all."""
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference occurs in the prediction (case-insensitive), else 0; RULER's string_match_part."""
    pred = prediction.lower()
    return float(any(ref.lower() in pred for ref in references))


def parse_first_int(text: str) -> int | None:
    """The first integer in ``text`` (how a pass key answer is read), or None."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a chain of thought: the last ``\\boxed{}``, else what follows ``####``, else what
    follows the last "answer is", else the last number; None if there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    m = list(re.finditer(r"answer is[:\s]*(.+)", text, flags=re.IGNORECASE))
    if m:
        return m[-1].group(1).strip().split("\n")[0].rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _unwrap(s: str, command: str) -> str:
    """Replaces ``\\command{x}`` by ``x`` (one level of braces)."""
    return re.sub(r"\\" + command + r"\{([^{}]*)\}", r"\1", s)


def normalize_answer(answer: str) -> str:
    """Canonical form of a final answer: no spaces, ``$``, ``\\left``/``\\right``, ``\\text{}``, units of degrees
    or percent, thousands separators or trailing period; ``dfrac``/``tfrac`` as ``frac``; ``x = 5`` as ``5``;
    numbers in their shortest form (``3.50`` -> ``3.5``, ``007`` -> ``7``)."""
    s = answer.strip().strip("$").strip()
    for cmd in ("text", "textbf", "mathrm", "mbox"):
        s = _unwrap(s, cmd)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""),
                     ("dfrac", "frac"), ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""),
                     ("%", ""), ("\\$", ""), ("$", "")):
        s = s.replace(old, new)
    s = "".join(s.split()).rstrip(".")
    if re.fullmatch(r"[a-zA-Z]\w*=.+", s) and s.count("=") == 1:
        s = s.split("=", 1)[1]
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+(\.\d+)?", s):
        value = float(s)
        s = str(int(value)) if value == int(value) else repr(value)
    return s


def answers_match(prediction: str | None, reference: str) -> bool:
    """Exact match of normalised final answers; numbers compare by value."""
    return prediction is not None and normalize_answer(prediction) == normalize_answer(reference)
