"""Metrics of the evaluation harness against values worked out by hand."""

import pytest

from sparsekv.eval.metrics import (answers_match, classification_score, code_similarity, count_score,
                                   extract_answer, lcs_length, normalize_answer, normalize_text, parse_first_int,
                                   qa_f1, retrieval_score, rouge_l, string_match)


def test_normalize_text_drops_case_punctuation_articles():
    assert normalize_text("The  Cat, a dog!") == "cat dog"


def test_qa_f1_known_values():
    assert qa_f1("the cat sat", "cat sat") == 1.0
    # pred {cat, sat, down}, ref {cat, sat}: precision 2/3, recall 1 -> 0.8
    assert qa_f1("cat sat down", "cat sat") == pytest.approx(0.8)
    assert qa_f1("dog", "cat") == 0.0
    assert qa_f1("", "cat") == 0.0


def test_lcs_and_rouge_l_known_values():
    assert lcs_length("abcbdab", "bdcaba") == 4
    # LCS of the words = "the cat the mat" (4 of 6 and 4 of 6 words) -> 2/3
    assert rouge_l("the cat sat on the mat", "the cat was under the mat") == pytest.approx(2 / 3)
    # LCS 2 ("police gunman"): precision 2/3, recall 2/6 -> 4/9
    assert rouge_l("police killed gunman", "police kill the gunman police killed") == pytest.approx(4 / 9)
    assert rouge_l("a b", "c d") == 0.0


def test_classification_score_like_longbench():
    classes = ["Location", "Human being", "Human", "Number"]
    assert classification_score("Location", "Location", classes) == 1.0
    assert classification_score("Location or Number", "Number", classes) == 0.5
    # "Human" is part of the reference "Human being", so only the reference counts.
    assert classification_score("Human being", "Human being", classes) == 1.0
    assert classification_score("Number", "Location", classes) == 0.0


def test_retrieval_count_and_code_scores():
    assert retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert retrieval_score("3 or 4", "Paragraph 3") == 0.5
    assert count_score("There are 7 unique paragraphs, 7.", 7) == 1.0
    assert count_score("5 or 7", 7) == 0.5
    assert code_similarity("```\n# comment\nx = 1\n", "x = 1") == 1.0
    # "abcd" vs "abxd": LCS 3 -> 2 * 3 / 8
    assert code_similarity("abcd", "abxd") == pytest.approx(0.75)


def test_string_match_fraction():
    assert string_match("VAR ABC and VAR XYZ", ["ABC", "XYZ", "QQQ", "RRR"]) == 0.5
    assert string_match("the number is 1234567.", ["1234567"]) == 1.0


def test_passkey_parsing():
    assert parse_first_int(" 41235. Remember it.") == 41235
    assert parse_first_int("no digits") is None
    assert parse_first_int("key 7 and 8") == 7


@pytest.mark.parametrize("text, answer", [
    ("so 3 + 4 = 7\n#### 7", "7"),
    ("we get \\boxed{\\frac{1}{2}} and then \\boxed{42}", "42"),
    ("thus $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("The answer is 18.", "18"),
    ("first 3 then 12 apples", "12"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_extract_answer_none_without_numbers():
    assert extract_answer("no idea") is None


@pytest.mark.parametrize("pred, ref", [
    ("1,000", "1000"), ("3.50", "3.5"), ("$18", "18"), ("x = 5", "5"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("90^\\circ", "90"), ("\\text{(C)}", "(C)"), ("007", "7"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
])
def test_answers_match_after_normalisation(pred, ref):
    assert answers_match(pred, ref)


def test_answers_differ():
    assert not answers_match("17", "18")
    assert not answers_match(None, "18")
    assert normalize_answer("2.0") == "2"
