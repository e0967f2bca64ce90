"""structgen: typed, validated outputs from language models.

    import structgen
    customer = structgen.generate(Customer, "Extract the customer: ...")
"""

from typing import TYPE_CHECKING, Any

from structgen.api import LLM, generate
from structgen.arguments import GenerateOptions
from structgen.completion import Completion, ReasoningDelta
from structgen.engine.config import EngineConfig, EngineTuning, SpeculativeConfig
from structgen.engine.request import GenerationStats
from structgen.errors import (
    ConstraintTooLargeError,
    EngineBusyError,
    EngineError,
    IncompleteOutputError,
    InvalidConstraintError,
    InvalidParameterError,
    ModelLoadError,
    ModelNotFoundError,
    OutputValidationError,
    PromptTooLongError,
    RequestCancelledError,
    StructgenError,
    StructgenWarning,
    ToolTimeoutError,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen.partial import Partial, PartialStream
from structgen.sampling import SamplingParams
from structgen.schema.limits import ConstraintLimits
from structgen.tool_runs import ToolError, ToolRun, ToolRunTooLongError, run_tools
from structgen.tools import Tool, ToolCall, ToolCalls, tool
from structgen.types import CFG, Choice, JsonSchema, Regex

if TYPE_CHECKING:
    from structgen.remote import RemoteLLM, RemoteStats


def __getattr__(name: str) -> Any:
    # The HTTP client loads only for those who use it.
    if name in ("RemoteLLM", "RemoteStats"):
        from structgen import remote

        return getattr(remote, name)
    raise AttributeError(f"module 'structgen' has no attribute {name!r}")


__all__ = [
    "ConstraintLimits",
    "LLM",
    "RemoteLLM",
    "RemoteStats",
    "generate",
    "Completion",
    "ReasoningDelta",
    "Partial",
    "PartialStream",
    "GenerationStats",
    "GenerateOptions",
    "SamplingParams",
    "EngineConfig",
    "EngineTuning",
    "SpeculativeConfig",
    "JsonSchema",
    "Regex",
    "CFG",
    "Choice",
    "tool",
    "run_tools",
    "Tool",
    "ToolCall",
    "ToolCalls",
    "ToolError",
    "ToolRun",
    "ToolRunTooLongError",
    "StructgenError",
    "StructgenWarning",
    "UnsupportedSchemaError",
    "UnsupportedTypeError",
    "InvalidConstraintError",
    "UnsatisfiableConstraintError",
    "ConstraintTooLargeError",
    "InvalidParameterError",
    "IncompleteOutputError",
    "OutputValidationError",
    "ModelNotFoundError",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestCancelledError",
    "EngineBusyError",
    "EngineError",
    "ToolTimeoutError",
]
