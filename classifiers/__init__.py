"""Request pricing and classing: tokenizers, prompt-cost estimation, size-class rules."""

from classifiers.classes import BOUNDS, SCALAR, Classifier, ClassRule, RequestClass
from classifiers.pricing import (
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    Cost,
    InvalidRequest,
    Pricer,
    PricingSettings,
)
from classifiers.tokenizers import (
    BytesTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerRegistry,
    default_tokenizer,
    load_tiktoken,
    load_tokenizer,
)

__all__ = [
    "BOUNDS",
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
    "SCALAR",
    "BytesTokenizer",
    "ClassRule",
    "Classifier",
    "Cost",
    "HFTokenizer",
    "InvalidRequest",
    "Pricer",
    "PricingSettings",
    "RequestClass",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerRegistry",
    "default_tokenizer",
    "load_tiktoken",
    "load_tokenizer",
]
