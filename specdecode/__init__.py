"""specdecode: speculative decoding that keeps the target's output exactly, only sooner."""

from specdecode.api import Generation, Model, generate, load_model, stream
from specdecode.errors import SpecDecodeError
from specdecode.core.sampling import SamplingConfig

__all__ = ["Generation", "Model", "SamplingConfig", "SpecDecodeError", "generate", "load_model", "stream"]
