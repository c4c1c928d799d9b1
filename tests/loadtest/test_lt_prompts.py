import pytest

from loadtest.prompts import PromptFactory


@pytest.fixture(scope="module")
def factory() -> PromptFactory:
    return PromptFactory(seed=5)


@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 31, 129, 1020, 4142, 14050, 28000])
def test_prompt_has_exactly_the_requested_token_count(factory: PromptFactory, tokens: int) -> None:
    text = factory.text(tokens, request_seed=tokens * 7)
    assert factory.count(text) == tokens


def test_prompts_are_words_and_vary_per_request(factory: PromptFactory) -> None:
    a, b = factory.text(500, request_seed=1), factory.text(500, request_seed=2)
    assert a != b  # different leading words: a prefix cache cannot serve one from the other
    assert a[-200:] == b[-200:]  # the body is shared per length (cached)
    assert all(w.isalpha() for w in a.split())


def test_same_seed_same_text() -> None:
    assert PromptFactory(seed=1).text(300, 9) == PromptFactory(seed=1).text(300, 9)
