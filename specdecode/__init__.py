"""specdecode: speculative decoding that keeps the target model's output exactly, only sooner.

The public API (api.py) is imported on first use, so that the command line can check its
flags before torch loads (seconds).
"""

from specdecode.errors import SpecDecodeError

_API = {"Generation", "Model", "generate", "load_model", "stream"}
__all__ = sorted(_API | {"SamplingConfig", "SpecDecodeError"})


def __getattr__(name: str):
    if name in _API:
        from specdecode import api

        return getattr(api, name)
    if name == "SamplingConfig":
        from specdecode.core.sampling import SamplingConfig

        return SamplingConfig
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
