"""specdecode: speculative decoding that keeps the target's output exactly, only sooner."""

from .api import Generation, Model, generate, load_model, stream
from .errors import SpecDecodeError
from .sampling import SamplingConfig

__all__ = ["Generation", "Model", "SamplingConfig", "SpecDecodeError", "generate", "load_model", "stream"]
