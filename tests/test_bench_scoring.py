"""GSM8K final-number match."""
from __future__ import annotations

import pytest

from fluxlab.bench.scoring import final_number, get_scorer, gsm8k_correct


@pytest.mark.parametrize("text,value", [
    ("She has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18. #### 18", 18.0),
    ("So the answer is $1,300.", 1300.0),
    ("The answer is: **42**", 42.0),
    ("first 3 then 4 then finally 7.5 apples", 7.5),
    ("a loss of -12 dollars", -12.0),
    ("#### 5 ... and later 99", 5.0),  # an explicit mark wins over a later number
    ("no digits here", None),
])
def test_final_number(text, value):
    assert final_number(text) == value


def test_reference_may_be_a_full_solution_or_a_number():
    assert gsm8k_correct("so 2 + 3 = 5. The answer is 5", "Adding gives 2+3=5.\n#### 5")
    assert gsm8k_correct("Total: 1,300", "1300")
    assert gsm8k_correct("18.00 dollars", "18")
    assert not gsm8k_correct("I think 17", "18")
    assert not gsm8k_correct("", "18")


def test_scorer_lookup():
    assert get_scorer("gsm8k") is gsm8k_correct
    assert get_scorer(None) is None
    with pytest.raises(ValueError, match="workload.scorer='bleu'"):
        get_scorer("bleu")


def test_arith_scorer_wants_the_replys_final_statement():
    from fluxlab.bench.scoring import get_scorer

    score = get_scorer("arith")
    assert score("12 + 30 = 42. The answer is 42.", "42")
    assert not score("12 + 30 = 42. The answer is 41.", "42")
    assert not score("The answer is 42. 7", "42")  # trailing noise
    assert not score("12 + 30 = 42.", "42")  # no final statement
