"""Answer extraction and equivalence (math), the format and arith rules, and the plug-in registry."""
from __future__ import annotations

import pytest

from moeloop.reward.answer import answers_equal, extract_answer
from moeloop.reward.registry import BUILTIN_REWARDS, as_result, get_reward_fn, is_async_fn
from moeloop.reward.rules import arith_answer, arith_reward, format_reward, math_reward
from moeloop.types import RewardResult, Sample

EXTRACT = [  # completion text, extracted answer
    ("so the total is\n#### 42", "42"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("The answer is $\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}"),
    ("nested \\boxed{\\sqrt{\\frac{1}{2}}} here", "\\sqrt{\\frac{1}{2}}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("It costs 1,250 dollars in total", "1,250"),
    ("the temperature fell to -7 degrees", "-7"),
    ("roughly 3.75 and then 12", "12"),
    ("I have no idea.", None),
    ("", None),
]

EQUAL = [  # gold, predicted answer, equal?
    ("0.5", "\\frac{1}{2}", True),  # fractions
    ("1/2", "\\frac12", True),
    ("\\frac{3}{4}", "\\dfrac{3}{4}", True),  # LaTeX variants
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
    ("42", "42 \\text{ dollars}", True),  # units
    ("5", "5\\text{cm}", True),
    ("1000", "1,000", True),  # thousands separators
    ("1234567", "1,234,567", True),
    ("-3", "-3", True),  # negatives
    ("-3", "3", False),
    ("\\$18", "18", True),
    ("7", "8", False),
    ("\\frac{1}{3}", "0.33", False),
]


@pytest.mark.parametrize("text,expected", EXTRACT)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize("gold,pred,equal", EQUAL)
def test_answers_equal(gold: str, pred: str, equal: bool) -> None:
    assert answers_equal(gold, pred) is equal


MATH = [  # response, ground truth, score
    ("48/2 = 24, 24+48 = 72\n#### 72", "Natalia ... 48+24 = <<48+24=72>>72\n#### 72", 1.0),
    ("So the probability is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("the answer is 1,000", "1000", 1.0),
    ("the answer is \\boxed{-5}", "5", 0.0),
    ("I cannot solve this", "12", 0.0),
]


@pytest.mark.parametrize("response,gold,score", MATH)
def test_math_reward(response: str, gold: str, score: float) -> None:
    res = math_reward(Sample(prompt_ids=[], response_text=response, ground_truth=gold))
    assert res.score == score
    assert "pred" in res.info and "gold" in res.info


def test_math_reward_no_answer_is_recorded() -> None:
    res = math_reward(Sample(prompt_ids=[], response_text="no idea", ground_truth="3"))
    assert res.info["pred"] is None and res.info["reason"] == "no answer"


ARITH = [  # documented rule: the integer after the last "Answer:", else the last integer of the text
    ("3 + 4 = 7", 7), ("Answer: 12", 12), ("Answer: -3 (checked 5 times)", -3),
    ("answer: 8 but Answer: 9", 9), ("12 then 13", 13), ("no digits", None),
    ("Answer: 12.", 12), ("Answer: 12.5", None), ("Answer: none, 3", None),
]


@pytest.mark.parametrize("text,expected", ARITH)
def test_arith_answer(text: str, expected: int | None) -> None:
    assert arith_answer(text) == expected


def test_arith_reward_exact_integer() -> None:
    assert arith_reward(Sample(prompt_ids=[], response_text="Answer: 12", ground_truth=12)).score == 1.0
    assert arith_reward(Sample(prompt_ids=[], response_text="Answer: 12", ground_truth=" 12")).score == 1.0
    assert arith_reward(Sample(prompt_ids=[], response_text="Answer: 12.0", ground_truth=12)).score == 0.0
    with pytest.raises(ValueError, match="ground_truth must be an integer"):
        arith_reward(Sample(prompt_ids=[], response_text="1", ground_truth="x"))


def test_format_reward_default_and_per_sample_pattern() -> None:
    good = Sample(prompt_ids=[], response_text="<think>a</think> <answer>4</answer>")
    bad = Sample(prompt_ids=[], response_text="4")
    custom = Sample(prompt_ids=[], response_text="Answer: 4", metadata={"format_pattern": r"Answer: \d+$"})
    assert [format_reward(s).score for s in (good, bad, custom)] == [1.0, 0.0, 1.0]


def user_reward(sample: Sample) -> RewardResult:
    return RewardResult(len(sample.response_text), {"who": "user"})


class UserRewardClass:
    def __init__(self, bonus: float = 0.0) -> None:
        self.bonus = bonus

    async def __call__(self, sample: Sample) -> RewardResult:
        return RewardResult(1.0 + self.bonus)


def test_registry_builtins_and_dotted_paths() -> None:
    assert set(BUILTIN_REWARDS) == {"math", "format", "arith", "code", "http", "reward_model"}
    assert get_reward_fn("arith") is arith_reward
    fn = get_reward_fn(f"{__name__}.user_reward")
    assert fn(Sample(prompt_ids=[], response_text="abc")).score == 3
    obj = get_reward_fn(f"{__name__}.UserRewardClass", bonus=1.0)
    assert is_async_fn(obj) and not is_async_fn(fn)


@pytest.mark.parametrize("name,match", [
    ("nope", "neither a built-in"), ("no_such_pkg_xyz.fn", "cannot import module"),
    (f"{__name__}.missing", "has no attribute"),
])
def test_registry_errors_name_the_field(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        get_reward_fn(name)
    assert "reward.fn" in str(err.value)


def test_as_result_accepts_floats_and_verl_score_dicts() -> None:
    assert as_result(0.5).score == 0.5
    verl = as_result({"score": 1, "acc": True, "pred": "72"})
    assert (verl.score, verl.info) == (1.0, {"acc": True, "pred": "72"})
    for value in ("1.0", True, {"score": "1"}, {"acc": 1.0}):
        with pytest.raises(TypeError, match="expected RewardResult, a float or a dict with a numeric 'score'"):
            as_result(value)


async def verl_async_score(data_source, solution_str, ground_truth):
    return float(solution_str.strip() == ground_truth)


def test_an_async_verl_compute_score_runs_on_the_pools_loop() -> None:
    """An `async def` verl compute_score (no extra_info parameter) stays async behind the adapter."""
    import asyncio

    from moeloop.reward.registry import is_async_fn
    from moeloop.types import Sample
    fn = get_reward_fn(f"{__name__}.verl_async_score")
    assert is_async_fn(fn)
    sample = Sample(prompt_ids=[1], response_text=" 12", ground_truth="12", metadata={"extra_info": {"x": 1}})
    assert asyncio.run(fn(sample)) == 1.0
