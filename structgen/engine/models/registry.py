"""Which model class runs a checkpoint: one module per family, chosen by its architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from structgen.engine.config import ModelConfig


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The module class for `cfg.architecture` (config.SUPPORTED_ARCHITECTURES)."""
    if cfg.architecture == "Gemma3ForCausalLM":
        from structgen.engine.models.gemma3 import Gemma3Model

        return Gemma3Model
    if cfg.architecture == "Phi3ForCausalLM":
        from structgen.engine.models.phi3 import Phi3Model

        return Phi3Model
    if cfg.num_experts:
        from structgen.engine.models.moe import MoeModel

        return MoeModel
    from structgen.engine.models.llama import LlamaModel

    return LlamaModel
