"""Shared fixtures for the classifiers tests."""

from __future__ import annotations

import pytest

from classifiers import Pricer, TokenizerRegistry


@pytest.fixture(scope="module")
def pricer() -> Pricer:
    """A pricer with the default tokenizers, one per test module (a module may override it)."""
    return Pricer(TokenizerRegistry())
