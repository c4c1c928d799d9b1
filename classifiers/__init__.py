"""Request pricing and classing: tokenizers, prompt-cost estimation, size-class rules."""

from classifiers.classes import Classifier, ClassRule, RequestClass, parse_rules
from classifiers.pricing import (
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    Cost,
    InvalidRequest,
    Pricer,
    PricingSettings,
    show_value,
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
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
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
    "parse_rules",
    "show_value",
]
