"""structgen: typed, validated outputs from language models.

    import structgen
    customer = structgen.generate(Customer, "Extract the customer: ...")
"""

from structgen.api import LLM, Completion, generate
from structgen.engine.config import EngineConfig
from structgen.engine.request import GenerationStats
from structgen.engine.sampler import SamplingParams
from structgen.errors import (
    IncompleteOutputError,
    InvalidConstraintError,
    InvalidParameterError,
    ModelNotFoundError,
    OutputValidationError,
    PromptTooLongError,
    StructgenError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen.tools import run_tools, tool
from structgen.types import CFG, Choice, JsonSchema, Regex

__all__ = [
    "LLM",
    "generate",
    "Completion",
    "GenerationStats",
    "SamplingParams",
    "EngineConfig",
    "JsonSchema",
    "Regex",
    "CFG",
    "Choice",
    "tool",
    "run_tools",
    "StructgenError",
    "UnsupportedSchemaError",
    "UnsupportedTypeError",
    "InvalidConstraintError",
    "InvalidParameterError",
    "IncompleteOutputError",
    "OutputValidationError",
    "ModelNotFoundError",
    "PromptTooLongError",
]
