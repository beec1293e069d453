"""Answer extraction from a response: the last \\boxed{...} and the last integer (pure functions; the checking against
the reference, in worker processes, is tests/process/test_rewards.py)."""
from sparserl.rewards.math import extract_boxed, extract_last_integer


def test_extract_boxed():
    assert extract_boxed("so \\boxed{42}.") == "42"
    assert extract_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("x = \\boxed{\\left\\{ a^{2}, b_{c} \\right\\}} done") == "\\left\\{ a^{2}, b_{c} \\right\\}"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("the answer is \\boxed 5 ok") == "5"
    assert extract_boxed("\\boxed{3} and unbalanced \\boxed{4") == "3"
    assert extract_boxed("no box here") is None
    assert extract_boxed("\\boxed{}") == ""


def test_extract_last_integer():
    assert extract_last_integer("3 + 4 = 7") == 7
    assert extract_last_integer("The answer is -12.") == -12
    assert extract_last_integer("10-3 is 7, no wait 10-3") == 3
    assert extract_last_integer("costs $1,234 total") == 1234
    assert extract_last_integer("12.0") == 12
    assert extract_last_integer("about 2.5") is None
    assert extract_last_integer("nothing") is None
